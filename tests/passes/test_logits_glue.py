"""logits_glue.scaling_head_input: compute_logits scales vLLM's hidden states as the source
scales the lm_head's input (the analysis proved the factor constant)."""

from types import SimpleNamespace

import libcst as cst
import pytest

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.logits_glue import scaling_head_input
from hfrewrite.errors import HfrewriteError

TEMPLATE = """\
class ForCausalLM:
    def compute_logits(self, hidden_states):
        return self.logits_processor(self.lm_head, hidden_states)
"""
PLAN = SimpleNamespace(lm_head="lm_head", architecture="ForCausalLM")


def scaled(forward_body: str) -> str:
    forward = t.stmt("def forward(self, input_ids, slice_indices):\n" + forward_body)
    tpl = t.find_class(cst.parse_module(TEMPLATE), "ForCausalLM")
    out = scaling_head_input(tpl, forward, PLAN)
    body = t.find_method(out, "compute_logits").body.body
    return t.code(body[0]).strip().splitlines()[-1]


def test_the_argument_itself():
    assert (
        scaled("    h = self.model(input_ids)[0]\n    return self.lm_head(h * self.scale)\n")
        == "hidden_states = hidden_states * self.scale"
    )


def test_through_the_forward_s_own_rescaling_and_the_kept_tokens():
    # minicpm3: the scale is a statement of its own, the call selects the tokens to keep
    source = (
        "    outputs = self.model(input_ids)\n"
        "    hidden_states = outputs.last_hidden_state\n"
        "    hidden_states = hidden_states / self.config.logits_scaling\n"
        "    logits = self.lm_head(hidden_states[:, slice_indices, :])\n"
        "    return logits\n"
    )
    assert scaled(source) == "hidden_states = hidden_states / self.config.logits_scaling"


def test_two_rescalings_keep_their_order():
    source = (
        "    h = self.model(input_ids)[0]\n"
        "    h = h / self.a\n"
        "    h = self.b * h\n"
        "    h = h + 0\n"
        "    return self.lm_head(h)\n"
    )
    assert scaled(source) == "hidden_states = (self.b * (hidden_states / self.a)) + 0"


def test_a_rescaling_after_the_call_is_not_read():
    source = (
        "    h = self.model(input_ids)[0]\n    logits = self.lm_head(h)\n    h = h * 2\n    return logits\n"
    )
    assert scaled(source) == "hidden_states = hidden_states"


def test_an_input_of_two_names_is_refused():
    with pytest.raises(HfrewriteError, match="scaled input is not one expression"):
        scaled("    h = self.model(input_ids)[0]\n    return self.lm_head(h * input_ids)\n")


@pytest.mark.parametrize(
    "rebinding",
    ["    h *= self.scale\n", "    if self.config.scale_logits:\n        h = h * 2\n"],
)
def test_a_rescaling_that_is_not_one_assignment_is_refused(rebinding):
    # augmented, or under a branch: reading on would drop it from the file
    source = "    h = self.model(input_ids)[0]\n" + rebinding + "    return self.lm_head(h / self.a)\n"
    with pytest.raises(HfrewriteError, match="scaled input is not one expression"):
        scaled(source)


def test_an_argument_expression_reads_through_the_rescaling_before_it():
    source = "    h = self.model(input_ids)[0]\n    h = h / self.a\n    return self.lm_head(h * self.b)\n"
    assert scaled(source) == "hidden_states = (hidden_states / self.a) * self.b"


def test_a_scaled_lm_head_input_in_the_source_is_carried_whatever_the_traced_factor():
    """The example run cannot tell a factor of 1 from none: the source's arithmetic on the
    head's input is what the file carries."""
    from hfrewrite.emit.logits_glue import scales_head_input

    def forward(body: str):
        return t.stmt("def forward(self, input_ids, slice_indices):\n" + body)

    assert scales_head_input(
        forward("    h = self.model(input_ids)[0]\n    return self.lm_head(h * self.scale)\n"), "lm_head"
    )
    assert not scales_head_input(
        forward("    h = self.model(input_ids)[0]\n    return self.lm_head(h[:, slice_indices, :])\n"),
        "lm_head",
    )


def test_a_factor_on_the_lm_heads_line_is_carried_into_compute_logits():
    """Falcon-H1's ``logits = self.lm_head(h) * self.model.lm_head_multiplier``."""
    from hfrewrite.emit.logits_glue import logits_statements

    forward = t.stmt(
        "def forward(self, input_ids, slice_indices):\n"
        "    h = self.model(input_ids)[0]\n"
        "    logits = self.lm_head(h[:, slice_indices, :]) * self.model.lm_head_multiplier\n"
        "    return logits\n"
    )
    (carried,) = logits_statements(forward, "lm_head")
    assert t.code(carried).strip() == "logits = logits * self.model.lm_head_multiplier"
