"""Look-alikes: code spelled like a known pattern that computes something else.

The analysis decides from what the traced code computes (numeric replay), never from
names: an interleaving ``rotate_half`` is proven GPT-J style, a sign-flipped one turns by
-theta, one that drops lanes matches no rope vLLM has, a ``(1 + weight)`` norm named
``RMSNorm`` is vLLM's ``GemmaRMSNorm``.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from torch import nn

from hfrewrite.analyze.attention import analyze_attention
from hfrewrite.analyze.norm import analyze_norm
from hfrewrite.analyze.norm_kinds import NormKind
from hfrewrite.analyze.plan import NoMatch
from hfrewrite.analyze.rope_styles import RopeLayers, RopeStyle, RopeTurn
from hfrewrite.analyze.trace import opaque_attention, trace

HEADS, HEAD_DIM, SEQ = 2, 16, 5
CONFIG = transformers.LlamaConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, head_dim=HEAD_DIM)


def rotate_half_neox(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_interleaved(x):  # helium's, under the usual name
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rotate_half_flipped(x):  # nanochat's: the rotation runs the other way
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((x2, -x1), dim=-1)


def rotate_half_lossy(x):  # looks like rotate_half, loses the first half
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x2), dim=-1)


def tables(interleaved: bool, base: float = 10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs = torch.arange(SEQ).float()[:, None] * inv_freq[None, :]
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[None], emb.sin()[None]  # [1, seq, head_dim]


class RopeAttention(nn.Module):
    def __init__(self, rotate):
        super().__init__()
        self.rotate = rotate
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(HEADS * HEAD_DIM, HEADS * HEAD_DIM, bias=False) for _ in range(4)
        )

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = (
            p(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + self.rotate(q) * sin
        k = k * cos + self.rotate(k) * sin
        out, _ = opaque_attention(self, q, k, v, None, scaling=HEAD_DIM**-0.5)
        return self.o_proj(out.reshape(b, s, -1))


def attention_plan(rotate, interleaved_tables: bool):
    x = torch.randn(1, SEQ, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(0))
    return analyze_attention(trace(RopeAttention(rotate), (x, *tables(interleaved_tables))), "", CONFIG)


def test_neox_rope_is_proven_neox():
    plan = attention_plan(rotate_half_neox, interleaved_tables=False)
    assert (plan.rope_layers, plan.rope_style, plan.rotary_dim) == (RopeLayers.ALL, RopeStyle.NEOX, HEAD_DIM)


def test_interleaving_rotate_half_is_proven_gptj_style():
    plan = attention_plan(rotate_half_interleaved, interleaved_tables=True)
    assert (plan.rope_layers, plan.rope_style) == (RopeLayers.ALL, RopeStyle.GPTJ)


def test_sign_flipped_rotate_half_is_proven_reversed():
    plan = attention_plan(rotate_half_flipped, interleaved_tables=False)
    assert (plan.rope_layers, plan.rope_style, plan.rope_turn) == (
        RopeLayers.ALL,
        RopeStyle.NEOX,
        RopeTurn.REVERSED,
    )


def test_a_rope_of_a_base_the_source_computes_is_refused_with_that_base():
    # TeleChat's NTK alpha: the base is 10000 * alpha ** (d / (d - 2)), from the head size
    x = torch.randn(1, SEQ, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(0))
    base = 10000.0 * 3 ** (HEAD_DIM / (HEAD_DIM - 2))
    plan = analyze_attention(trace(RopeAttention(rotate_half_neox), (x, *tables(False, base))), "", CONFIG)
    assert isinstance(plan, NoMatch)
    found = re.search(r"a default rope of base (\d+), not 10000 \(the config's rope_theta", plan.reason)
    assert found and abs(float(found[1]) / base - 1) < 1e-3, plan.reason


class SeqFirstRopeAttention(RopeAttention):
    """TeleChat's layout: the rope turns [seq, batch * heads, head_dim] operands."""

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = (
            p(x).transpose(0, 1).view(s, b, HEADS, HEAD_DIM).reshape(s, b * HEADS, HEAD_DIM)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        cos, sin = cos.transpose(0, 1), sin.transpose(0, 1)  # [seq, 1, head_dim]
        q = q * cos + self.rotate(q) * sin
        k = k * cos + self.rotate(k) * sin
        q, k, v = (y.reshape(s, b, HEADS, HEAD_DIM).permute(1, 2, 0, 3) for y in (q, k, v))
        out, _ = opaque_attention(self, q, k, v, None, scaling=HEAD_DIM**-0.5)
        return self.o_proj(out.reshape(b, s, -1))


def test_a_rope_over_seq_first_merged_heads_is_proven():
    x = torch.randn(2, SEQ, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(0))
    plan = analyze_attention(trace(SeqFirstRopeAttention(rotate_half_neox), (x, *tables(False))), "", CONFIG)
    assert not isinstance(plan, NoMatch), plan.reason
    assert (plan.rope_layers, plan.rope_style, plan.rotary_dim) == (RopeLayers.ALL, RopeStyle.NEOX, HEAD_DIM)


def test_reversed_rope_is_refused_for_scaled_rope_types():
    # ReversedRotaryEmbedding rebuilds the default table only: a scaled type fails closed
    config = transformers.LlamaConfig(
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        head_dim=HEAD_DIM,
        rope_parameters={"rope_type": "linear", "factor": 1.0, "rope_theta": 10000.0},
    )
    x = torch.randn(1, SEQ, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(0))
    plan = analyze_attention(trace(RopeAttention(rotate_half_flipped), (x, *tables(False))), "", config)
    assert isinstance(plan, NoMatch)
    assert "rotary embedding: the replay matches no rope vLLM computes" in plan.reason


@pytest.mark.parametrize(
    "rotate, interleaved",
    [
        (rotate_half_lossy, False),  # drops lanes: no rotation at all
        (rotate_half_interleaved, False),  # interleaved lanes against half-split tables
    ],
)
def test_rope_lookalikes_are_rejected(rotate, interleaved):
    plan = attention_plan(rotate, interleaved)
    assert isinstance(plan, NoMatch)
    assert "rotary embedding: the replay matches no rope vLLM computes" in plan.reason


class RMSNorm(nn.Module):
    """Named like llama's; computes gemma's ``(1 + weight)`` form."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(dim)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def test_one_plus_weight_norm_named_rmsnorm_is_gemma_form():
    plan = analyze_norm(RMSNorm(8))
    assert (plan.kind, plan.eps) == (NormKind.GEMMA_RMS, 1e-6)


@pytest.mark.parametrize(
    "edits",
    [
        # a bias parameter, added to the output
        [
            (
                "__init__",
                "self.weight, self.eps = nn.Parameter(torch.zeros(dim)), eps",
                "self.weight, self.eps = nn.Parameter(torch.zeros(dim)), eps\n        self.bias = nn.Parameter(torch.zeros(dim))",
            ),
            ("forward", "* (1.0 + self.weight)", "* (1.0 + self.weight) + self.bias"),
        ],
        # a LayerNorm without bias, spelled with rsqrt(mean(x**2) + eps) after centring
        [
            (
                "forward",
                "return x * ",
                "x = x - x.mean(-1, keepdim=True)\n        return x * ",
            )
        ],
    ],
)
def test_norm_lookalikes_are_not_vllm_norms(mutate, edits):
    for method, old, new in edits:
        mutate(RMSNorm, method, (old, new))
    assert isinstance(analyze_norm(RMSNorm(8)), NoMatch)


# A q scaled before the rope, or an output scaled before o_proj: steps the rewrite would
# drop, so the analysis must refuse them.
@pytest.mark.parametrize(
    "edit, reason",
    [
        (
            (
                "cos, sin = cos.unsqueeze(1)",
                "q = q * 2.0\n        cos, sin = cos.unsqueeze(1)",
            ),
            "the q path computes mul",
        ),
        (
            ("self.o_proj(out.reshape(", "self.o_proj(torch.tanh(out).reshape("),
            "the attention output computes tanh",
        ),
    ],
)
def test_unkept_steps_around_the_attention_are_refused(mutate, edit, reason):
    mutate(RopeAttention, "forward", edit)
    plan = attention_plan(rotate_half_neox, interleaved_tables=False)
    assert isinstance(plan, NoMatch) and reason in plan.reason, plan
