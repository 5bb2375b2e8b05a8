"""k or v multiplied by a number of the module on its way to the attention, after the head
split (Falcon-H1's key multiplier, MiMo-V2-Flash's value scale; analyze/path_scale.py), and v
heads narrower than q's and k's: proven on the traced values, or refused."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from hfrewrite.analyze.attention import analyze_attention
from hfrewrite.analyze.plan import NoMatch
from hfrewrite.analyze.trace import opaque_attention, trace
from hfrewrite.emit.value_heads import after_attention, before_attention, key_scaled

CONFIG = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, head_dim=16)


class ScaledAttention(nn.Module):
    """q/k/v/o attention, k and v each times an attribute after the head split."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(32, 64, bias=False)
        self.k_proj = nn.Linear(32, 32, bias=False)
        self.v_proj = nn.Linear(32, 32, bias=False)
        self.o_proj = nn.Linear(64, 32, bias=False)
        self.key_multiplier = 0.5
        self.v_scale = 0.75

    def forward(self, x):
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, 16).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, 16).transpose(1, 2) * self.key_multiplier
        v = self.v_proj(x).view(batch, seq, -1, 16).transpose(1, 2) * self.v_scale
        out, _ = opaque_attention(self, q, k, v, None, scaling=0.25)
        return self.o_proj(out.reshape(batch, seq, -1))


def plan_of():
    return analyze_attention(trace(ScaledAttention(), (torch.randn(2, 3, 32),)), "", CONFIG)


def test_k_and_v_numbers_are_proven_k_folded_into_the_scale():
    plan = plan_of()
    assert plan.path_scales == (("k", "self.key_multiplier"), ("v", "self.v_scale"))
    assert plan.scaling == pytest.approx(0.25 * 0.5)
    assert plan.v_head_dim is None
    # the file's scale is the source's expression times the call's, v multiplied after the split
    assert key_scaled(plan, "self.scaling") == "self.key_multiplier * self.scaling"
    assert before_attention(plan, "self.head_dim") == "v = v * self.v_scale  # as the source scales v\n"
    assert after_attention(plan, "self.head_dim") == ""


def test_a_literal_number_is_its_own_expression(mutate):
    mutate(ScaledAttention, "forward", ("* self.key_multiplier", "* 0.5"))
    assert plan_of().path_scales == (("k", "0.5"), ("v", "self.v_scale"))


def test_a_number_off_another_line_is_refused(mutate):
    """The number must be the factor of the line that multiplies: here computed elsewhere."""
    mutate(
        ScaledAttention,
        "forward",
        ("k = self.k_proj(x)", "factor = self.key_multiplier * 2\n        k = self.k_proj(x)"),
        ("* self.key_multiplier", "* factor"),
    )
    plan = plan_of()
    assert isinstance(plan, NoMatch)
    assert "the k path computes mul" in plan.reason


def test_a_tensor_times_k_is_refused(mutate):
    mutate(ScaledAttention, "forward", ("* self.key_multiplier", "* self.k_proj.weight[0, 0]"))
    assert isinstance(plan_of(), NoMatch)


def test_narrower_v_heads_are_padded_around_the_attention(mutate):
    mutate(ScaledAttention, "__init__", ("self.v_proj = nn.Linear(32, 32", "self.v_proj = nn.Linear(32, 16"))
    mutate(ScaledAttention, "forward", ("transpose(1, 2) * self.v_scale", "transpose(1, 2)"))
    mutate(
        ScaledAttention,
        "forward",
        ("self.v_proj(x).view(batch, seq, -1, 16)", "self.v_proj(x).view(batch, seq, -1, 8)"),
    )
    mutate(ScaledAttention, "__init__", ("self.o_proj = nn.Linear(64, 32", "self.o_proj = nn.Linear(32, 32"))
    plan = plan_of()
    assert not isinstance(plan, NoMatch), plan
    assert (plan.head_dim, plan.v_head_dim, plan.path_scales) == (16, 8, (("k", "self.key_multiplier"),))
    assert "torch.nn.functional.pad" in before_attention(plan, "self.head_dim")
    assert "[..., : self.v_head_size]" in after_attention(plan, "self.head_dim")


def test_wider_v_heads_are_refused(mutate):
    mutate(ScaledAttention, "__init__", ("self.v_proj = nn.Linear(32, 32", "self.v_proj = nn.Linear(32, 64"))
    mutate(
        ScaledAttention,
        "forward",
        ("self.v_proj(x).view(batch, seq, -1, 16)", "self.v_proj(x).view(batch, seq, -1, 32)"),
    )
    mutate(ScaledAttention, "__init__", ("self.o_proj = nn.Linear(64, 32", "self.o_proj = nn.Linear(128, 32"))
    plan = plan_of()
    assert isinstance(plan, NoMatch)
    assert plan.reason == "k_proj and v_proj differ in out_features (32 != 64)"
