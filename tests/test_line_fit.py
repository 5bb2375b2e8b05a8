"""emit/line_fit.py: what the formatter leaves longer than vLLM's 88 columns is broken at
spaces, and the module still computes the same values."""

import ast

from hfrewrite.emit.line_fit import WIDTH, fit_lines

SOURCE = '''\
class Config:
    """A docstring line that goes on and on and on and on and on and on past the column limit."""

    def check(self, size, limit):
        # Hugging Face checkpoints keep the fused projections apart: each tensor is loaded into its shard;
        # stacked tensors go to the loader as they are.
        #
        # - a bullet
        total = size + limit  # a trailing comment long enough to push its line past the limit
        if total > 2 * limit:
            raise ValueError(f"size {size!r} with {{braces}} is larger than the limit, which is {limit}")
        message = "a plain literal that is much longer than the eighty-eight columns a line may have"
        table = {"mlp.moe_statics.e_score_correction_bias": "mlp.gate.moe_statics.e_score_correction_bias"}
        return message, table, total  # noqa: E501 a pragma stays where it is, however long its line
'''


def _values(text: str) -> tuple:
    namespace: dict = {}
    exec(compile(text, "<fitted>", "exec"), namespace)  # noqa: S102 - the module under test
    config = namespace["Config"]()
    try:
        config.check(100, 1)
    except ValueError as exc:
        raised = str(exc)
    return raised, config.check(1, 1000)


def test_long_lines_are_broken_and_the_values_stay():
    fitted = fit_lines(SOURCE)
    assert _values(fitted) == _values(SOURCE)
    long = [line for line in fitted.splitlines() if len(line) > WIDTH]
    # the literals are cut into parts (the formatter lays them out next); only the pragma's line stays
    assert all("(" in line or "noqa" in line for line in long), long


def test_comments_flow_into_the_next_line_of_their_paragraph():
    fitted = fit_lines(SOURCE)
    assert (
        "        # Hugging Face checkpoints keep the fused projections apart: each tensor is\n"
        "        # loaded into its shard; stacked tensors go to the loader as they are.\n"
        "        #\n"
        "        # - a bullet\n"
    ) in fitted
    # a comment after code moves above it
    assert (
        "        # a trailing comment long enough to push its line past the limit\n"
        "        total = size + limit\n"
    ) in fitted


def test_docstrings_continue_at_their_indentation():
    fitted = fit_lines(SOURCE)
    assert (
        '    """A docstring line that goes on and on and on and on and on and on past the column\n    limit."""'
        in fitted
    )


def test_f_strings_are_cut_outside_their_placeholders():
    fitted = fit_lines(SOURCE)
    line = next(line for line in fitted.splitlines() if "raise ValueError" in line)
    parts = [
        p for p in ast.walk(ast.parse(line.strip().replace("raise ", ""))) if isinstance(p, ast.JoinedStr)
    ]
    assert len(parts) == 1  # one f-string value, the concatenation of the parts
    assert ' "' in line and 'f"' in line  # a part with no placeholder lost its f


def test_a_dict_value_of_one_long_word_goes_in_parentheses():
    fitted = fit_lines(SOURCE)
    assert (
        '"mlp.moe_statics.e_score_correction_bias": ("mlp.gate.moe_statics.e_score_correction_bias")'
        in fitted
    )


def test_short_modules_are_unchanged():
    short = "def f(x):\n    # fine\n    return x  # fine\n"
    assert fit_lines(short) == short


def test_a_docstring_sentence_flows_into_its_next_line():
    source = (
        "def gelu(x):\n"
        '    """\n'
        "    Custom bias GELU function. Adapted from Megatron-DeepSpeed code. Here we use a simple implementation to\n"
        "    make the model jitable.\n"
        "\n"
        "    Args:\n"
        '    """\n'
        "    return x\n"
    )
    assert (
        "    Custom bias GELU function. Adapted from Megatron-DeepSpeed code. Here we use a\n"
        "    simple implementation to make the model jitable.\n"
        "\n"
        "    Args:\n"
    ) in fit_lines(source)


def test_an_f_string_whose_last_words_overflow_is_cut_before_them():
    # every space comes early; the placeholder after the last one pushes the line past 88
    line = '        raise ValueError(\n            f"embed_dim must be divisible by num_heads (got `embed_dim`: {self.embed_dim}"\n        )\n'
    text = f"def check(self):\n    if self.bad:\n{line}"
    fitted = fit_lines(text)  # (the formatter then puts each part on a line of its own)
    parts = ['"embed_dim must be divisible by num_heads (got `embed_dim`: "', 'f"{self.embed_dim}"']
    assert " ".join(parts) in fitted, fitted
    assert all(len(" " * 12 + p + ",") <= WIDTH for p in parts)
