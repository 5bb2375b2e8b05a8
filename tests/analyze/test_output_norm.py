"""A norm of the whole attention output before its projection (BitNet's attn_sub_norm): proven
on the traced values (it reads the heads as vLLM lays them, the projection reads its output,
it normalises each token alone); anything else on that path is refused with its reason."""

from __future__ import annotations

import torch
import transformers
from torch import nn

from hfrewrite.analyze.attention import analyze_attention
from hfrewrite.analyze.plan import AttentionPlan, NoMatch
from hfrewrite.analyze.trace import opaque_attention, trace

CONFIG = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16)


class SubNormRMSNorm(nn.Module):
    """An RMS norm over the last dimension (a childless *Norm: a traced leaf)."""

    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(size) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class TokenMixingNorm(nn.Module):
    """Normalises over the sequence: not per token."""

    def forward(self, x):
        return x / x.abs().amax(dim=-2, keepdim=True)


class SubNormAttention(nn.Module):
    def __init__(self, norm: nn.Module | None = None, per_head: bool = False, twice: bool = False):
        super().__init__()
        self.q_proj = nn.Linear(32, 64, bias=False)
        self.k_proj = nn.Linear(32, 64, bias=False)
        self.v_proj = nn.Linear(32, 64, bias=False)
        self.o_proj = nn.Linear(64, 32, bias=False)
        self.attn_sub_norm = norm if norm is not None else SubNormRMSNorm(16 if per_head else 64)
        self.per_head, self.twice = per_head, twice

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (
            p(x).view(batch, seq, -1, 16).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out, _ = opaque_attention(self, q, k, v, None, scaling=0.25)
        if self.per_head:  # [b, s, heads, d] normalised head by head: not the whole output
            out = self.attn_sub_norm(out)
        out = out.reshape(batch, seq, -1)
        if not self.per_head:
            out = self.attn_sub_norm(out)
        if self.twice:
            out = out * 2.0
        return self.o_proj(out)


def plan_of(module: nn.Module):
    return analyze_attention(trace(module, (torch.randn(2, 3, 32),)), "", CONFIG)


def test_a_norm_of_the_whole_output_is_proven_and_kept():
    plan = plan_of(SubNormAttention())
    assert isinstance(plan, AttentionPlan), plan
    assert plan.output_norm == "attn_sub_norm"
    assert plan.output_gate is None


def test_a_plain_attention_has_no_output_norm():
    class Plain(SubNormAttention):
        def forward(self, x):
            batch, seq, _ = x.shape
            q, k, v = (
                p(x).view(batch, seq, -1, 16).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
            )
            out, _ = opaque_attention(self, q, k, v, None, scaling=0.25)
            return self.o_proj(out.reshape(batch, seq, -1))

    assert plan_of(Plain()).output_norm is None


def test_a_norm_per_head_is_refused():
    plan = plan_of(SubNormAttention(per_head=True))
    assert isinstance(plan, NoMatch)
    assert "does not read the attention output as [heads * head_dim]" in plan.reason


def test_a_norm_mixing_tokens_is_refused():
    class MixingNorm(TokenMixingNorm):
        pass

    plan = plan_of(SubNormAttention(norm=MixingNorm()))
    assert isinstance(plan, NoMatch)
    assert "does not normalise each token alone" in plan.reason


def test_a_scale_after_the_norm_is_refused():
    plan = plan_of(SubNormAttention(twice=True))
    assert isinstance(plan, NoMatch)
    assert "multiplied by something other than a gate" in plan.reason
