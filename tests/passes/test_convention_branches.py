"""Branches of an attention forward on its calling convention (the inputs vLLM does not
pass, and locals computed from them alone) are decided by the lines the trace ran."""

from __future__ import annotations

import dataclasses
from textwrap import dedent

import libcst as cst
from hfrewrite.passes import taken_branches
from plans import llama_like

from hfrewrite.emit.attention_body import convention_locals
from hfrewrite.emit.pass_api import PassContext

SOURCE = """\
class LlamaAttention(nn.Module):
    def forward(self, hidden_states, past_key_values=None, encoder_hidden_states=None):
        is_cross = encoder_hidden_states is not None
        if past_key_values is not None:
            updated = past_key_values.is_updated.get(self.layer_idx)
        if is_cross:
            q = self.q_proj(encoder_hidden_states)
            k = encoder_hidden_states
        else:
            q = self.q_proj(hidden_states)
            k = hidden_states
        q = q * 2
        if q.shape[1] > 1:
            q = self.q_proj(q)
        return q, k
"""


def _forward():
    return cst.parse_module(dedent(SOURCE)).body[0].body.body[0]


def test_convention_locals_are_the_dropped_inputs_and_what_only_they_compute():
    # q and k are the forward's own: bound in a branch that reads the hidden states
    assert convention_locals(_forward()) == {
        "past_key_values",
        "encoder_hidden_states",
        "is_cross",
        "updated",
    }


def _run(ran: tuple[str, ...]):
    attention = dataclasses.replace(llama_like().attention, module_class="LlamaAttention", traced_lines=ran)
    plan = dataclasses.replace(llama_like(), attention=attention)
    return taken_branches.run(cst.parse_module(dedent(SOURCE)), PassContext(plan, "modeling_test.py"))


def test_the_branch_whose_own_lines_ran_is_kept():
    out = _run(("q = self.q_proj(hidden_states)", "return q, k")).module.code
    assert "if is_cross:" not in out and "q = self.q_proj(encoder_hidden_states)" not in out
    assert "        q = self.q_proj(hidden_states)\n        k = hidden_states\n" in out
    assert "if q.shape[1] > 1:" in out  # a test on the forward's own values is never decided


def test_nothing_is_decided_without_trace_evidence():
    assert _run(()).module.code == dedent(SOURCE)
    # lines both branches share prove nothing
    assert _run(("return q, k",)).module.code == dedent(SOURCE)
