"""A 4.x config's rope tied to its fields by sibling analyses (analyze/rope_constants.py).
The siblings are played by a stand-in for the analysis that computes the rope a source
would: ChatGLM3's ``10000 * rope_ratio`` over half of each head, a hard-coded base, a base
growing otherwise with the field, a width of fixed lanes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from hfrewrite.analyze.attention import analyze_attention
from hfrewrite.analyze.plan import NoMatch, Refusal
from hfrewrite.analyze.rope import refuse_rope
from hfrewrite.analyze.rope_constants import prove_rope_constants
from hfrewrite.analyze.trace import trace
from tests.analyze.test_lookalikes import RopeAttention, rotate_half_neox, tables

HEAD_DIM = 16


def traced_plan():
    x = torch.randn(1, 5, 2 * HEAD_DIM, generator=torch.Generator().manual_seed(0))
    config = transformers.LlamaConfig(hidden_size=2 * HEAD_DIM, num_attention_heads=2, head_dim=HEAD_DIM)
    plan = analyze_attention(trace(RopeAttention(rotate_half_neox), (x, *tables(False))), "", config)
    assert not isinstance(plan, NoMatch), plan.reason
    return plan


# the main analysis: half of each head turned at a base of 10000, no config field for either
MAIN = dataclasses.replace(traced_plan(), rotary_dim=HEAD_DIM // 2, rope_fields=(("rope_theta", "10000.0"),))
SMALL = transformers.PretrainedConfig(rope_ratio=1, kv_channels=HEAD_DIM, unrelated=1.0)


def source(base, width):
    """The analysis of a sibling of a source whose rope is ``base(fields)`` over
    ``width(head_dim)`` lanes: proves the rope it is given, else refuses it."""

    def analyze(edits: dict) -> object:
        fields = {"rope_ratio": 1, "kv_channels": HEAD_DIM} | edits
        head = fields["kv_channels"]
        given = edits["rope_parameters"]
        turned = int(head * given.get("partial_rotary_factor", 1.0))
        if given["rope_theta"] != base(fields) or turned != width(head):
            refuse_rope("no match", "SelfAttention")  # as the analysis refuses a rope
        return dataclasses.replace(MAIN, head_dim=head, rotary_dim=turned)

    return analyze


def half(head: int) -> int:
    return head // 2


def test_chatglms_base_and_width_are_a_field_times_10000_and_half_of_each_head():
    att = prove_rope_constants(MAIN, SMALL, source(lambda f: 10000.0 * f["rope_ratio"], half))
    assert att.rope_fields == (
        ("rope_theta", "10000.0 * config.rope_ratio"),
        ("partial_rotary_factor", "0.5"),
    )


def test_a_base_no_field_changes_is_the_constant():
    att = prove_rope_constants(MAIN, SMALL, source(lambda f: 10000.0, half))
    assert att.rope_fields == (("rope_theta", "10000.0"), ("partial_rotary_factor", "0.5"))


def test_a_base_a_field_changes_otherwise_is_refused():
    with pytest.raises(Refusal, match="config.rope_ratio changes the rope's base other than as its factor"):
        prove_rope_constants(MAIN, SMALL, source(lambda f: 10000.0 * f["rope_ratio"] ** 2, half))


def test_a_width_of_fixed_lanes_is_not_a_share_of_the_head():
    with pytest.raises(Refusal, match="no field doubling the head size proves it a share"):
        prove_rope_constants(MAIN, SMALL, source(lambda f: 10000.0, lambda head: HEAD_DIM // 2))


def test_a_sibling_refused_for_another_reason_proves_nothing_whatever_its_wording():
    """Only a refusal of the rope itself (its topic) says the sibling's rope is not the one
    given; another refusal, even worded like one, leaves the field undecided: the constant."""

    chatglm = source(lambda f: 10000.0 * f["rope_ratio"], half)

    def analyze(edits: dict) -> object:
        try:
            return chatglm(edits)
        except Refusal as refused:  # the same words, without the topic
            raise Refusal(NoMatch("vllm_attention", "SelfAttention", refused.no_match.reason)) from None

    att = prove_rope_constants(MAIN, SMALL, analyze)
    assert att.rope_fields[0] == ("rope_theta", "10000.0")
