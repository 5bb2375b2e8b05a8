"""The one exception type the CLI turns into a single error line and exit code 2."""


class HfrewriteError(Exception):
    """Bad input or an unsupported model: the message is shown to the user as is."""


class CannotBuild(HfrewriteError):
    """The model's own code does not build or run under the installed transformers (Hub
    custom code written for another release: its analysis is retried under that one)."""
