"""Megatron-era attention as ChatGLM writes it: sequence-first ``[seq, batch, hidden]``
operands, a rope helper compiled by ``@torch.jit.script``, k and v expanded to every query
head in that layout and permuted for torch's SDPA. The trace runs the helper's Python
function, the GQA expansion is found through the permute, and the rope is replayed in the
layout it turns."""

from __future__ import annotations

import torch
import transformers
from torch import nn

from hfrewrite.analyze.attention import analyze_attention
from hfrewrite.analyze.plan import NoMatch
from hfrewrite.analyze.rope_styles import RopeLayers, RopeStyle
from hfrewrite.analyze.trace import trace

HEADS, GROUPS, HEAD_DIM, SEQ = 4, 2, 16, 5
CONFIG = transformers.LlamaConfig(
    hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HEAD_DIM
)


@torch.jit.script
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [seq, batch, heads, head_dim]; neox halves
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def tables() -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs = torch.outer(torch.arange(SEQ).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [seq, 1, 1, head_dim]
    return emb.cos(), emb.sin()


class SeqFirstAttention(nn.Module):
    def __init__(self, expand: bool = True):
        super().__init__()
        self.expand = expand
        self.q_proj = nn.Linear(HEADS * HEAD_DIM, HEADS * HEAD_DIM, bias=False)
        self.k_proj, self.v_proj = (
            nn.Linear(HEADS * HEAD_DIM, GROUPS * HEAD_DIM, bias=False) for _ in range(2)
        )
        self.dense = nn.Linear(HEADS * HEAD_DIM, HEADS * HEAD_DIM, bias=False)

    def forward(self, x, cos, sin):  # x: [seq, batch, hidden]
        s, b, _ = x.shape
        q = self.q_proj(x).view(s, b, HEADS, HEAD_DIM)
        k = self.k_proj(x).view(s, b, GROUPS, HEAD_DIM)
        v = self.v_proj(x).view(s, b, GROUPS, HEAD_DIM)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = HEADS // GROUPS
        k = k.unsqueeze(-2).expand(-1, -1, -1, rep, -1).contiguous().view(s, b, HEADS, HEAD_DIM)
        v = v.unsqueeze(-2).expand(-1, -1, -1, rep, -1).contiguous().view(s, b, HEADS, HEAD_DIM)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.permute(2, 0, 1, 3).reshape(s, b, -1))


def test_sequence_first_attention_with_a_scripted_rope_and_expanded_kv_is_proven():
    x = torch.randn(SEQ, 2, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(0))
    plan = analyze_attention(trace(SeqFirstAttention(), (x, *tables())), "", CONFIG)
    assert not isinstance(plan, NoMatch), plan.reason
    assert (plan.num_heads, plan.num_kv_heads, plan.head_dim) == (HEADS, GROUPS, HEAD_DIM)
    assert (plan.rope_layers, plan.rope_style, plan.rotary_dim) == (RopeLayers.ALL, RopeStyle.NEOX, HEAD_DIM)
    assert "apply_rope" in plan.replaced_calls


def test_the_scripted_function_is_restored_after_the_trace():
    x = torch.randn(SEQ, 2, HEADS * HEAD_DIM)
    trace(SeqFirstAttention(), (x, *tables()))
    assert isinstance(apply_rope, torch.jit.ScriptFunction)
