"""The one exception type the CLI turns into a single error line and exit code 2."""


class HfrewriteError(Exception):
    """Bad input or an unsupported model: the message is shown to the user as is."""
