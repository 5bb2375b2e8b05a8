"""A rope of a base the source computes (TeleChat's NTK alpha): proven on the source's own
rotary module, whose table the file reads the base off at load, or refused where that table
is not one rope at every length."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from torch import nn

from hfrewrite.analyze.attention import analyze_attention
from hfrewrite.analyze.plan import NoMatch, RopeTable
from hfrewrite.analyze.trace import opaque_attention, trace
from hfrewrite.emit.position_code import SOURCE_ROPE_THETA

HEADS, HEAD_DIM, SEQ, LENGTH = 2, 16, 5, 64
CONFIG = transformers.LlamaConfig(
    hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, head_dim=HEAD_DIM, max_position_embeddings=LENGTH
)


def ntk_alpha(seq: int) -> int:  # TeleChat's form, for a model trained on 2 positions
    return max(2 ** math.ceil(math.log2(seq / 2) + 1) - 1, 1)


class NtkRotary(nn.Module):
    """Builds its cos/sin table for at least ``LENGTH`` positions (``clamped``, TeleChat) or
    for the sequence it is given (a dynamic NTK rope), its base grown by the NTK alpha."""

    def __init__(self, dim: int, clamped: bool, mscale: float = 1.0, trained: int = LENGTH):
        super().__init__()
        self.dim, self.clamped, self.mscale, self.trained = dim, clamped, mscale, trained

    def forward(self, x, seq_dim=1):
        seq = max(x.shape[seq_dim], self.trained) if self.clamped else x.shape[seq_dim]
        base = 10000 * ntk_alpha(seq) ** (self.dim / (self.dim - 2))
        inv_freq = 1.0 / base ** (torch.arange(0, self.dim, 2).float() / self.dim)
        freqs = torch.outer(torch.arange(seq).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return self.mscale * emb.cos(), self.mscale * emb.sin()


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class NtkAttention(nn.Module):
    def __init__(self, clamped: bool):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(HEADS * HEAD_DIM, HEADS * HEAD_DIM, bias=False) for _ in range(4)
        )
        self.rotary_emb = NtkRotary(HEAD_DIM, clamped)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (
            p(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        cos, sin = self.rotary_emb(x, seq_dim=1)
        cos, sin = cos[:s], sin[:s]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out, _ = opaque_attention(self, q, k, v, None, scaling=HEAD_DIM**-0.5)
        return self.o_proj(out.reshape(b, s, -1))


def plan_of(clamped: bool):
    x = torch.randn(1, SEQ, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(0))
    return analyze_attention(trace(NtkAttention(clamped), (x,)), "", CONFIG)


def source_rope_theta():
    scope = {"torch": torch, "nn": nn, "math": math}
    exec(SOURCE_ROPE_THETA, scope)  # noqa: S102 - the file's helper, as it is written there
    return scope["source_rope_theta"]


def test_a_base_the_source_computes_is_read_off_its_rotary_module():
    plan = plan_of(clamped=True)
    assert not isinstance(plan, NoMatch), plan.reason
    assert plan.rope_table == RopeTable("rotary_emb", "torch.zeros(1, n, 1, dtype=torch.float32), seq_dim=1")
    assert plan.max_position_field == "max_position_embeddings"


@pytest.mark.parametrize("length", [LENGTH, 4 * LENGTH])
def test_the_files_helper_reads_the_base_for_any_length(length):
    # the file's call, for a config trained on another length: the base of that length's alpha
    theta = source_rope_theta()(
        NtkRotary(HEAD_DIM, clamped=True, trained=length),
        lambda rope, n: rope(torch.zeros(1, n, 1)),
        length,
        HEAD_DIM,
    )
    want = 10000 * ntk_alpha(length) ** (HEAD_DIM / (HEAD_DIM - 2))
    assert theta == pytest.approx(want, rel=1e-5)


def test_a_table_that_depends_on_the_sequence_length_is_refused():
    # a dynamic NTK rope: the example's 5 positions see another base than the longest length
    plan = plan_of(clamped=False)
    assert isinstance(plan, NoMatch)
    assert "a base the source computes" in plan.reason and "not proven for other configs" in plan.reason


@pytest.mark.parametrize(
    "rotary", [NtkRotary(HEAD_DIM, clamped=False), NtkRotary(HEAD_DIM, True, mscale=1.1)]
)
def test_the_files_helper_raises_at_load_on_a_table_no_rope_has(rotary):
    # at load, for the real config: a table that changes with the length, or is scaled
    with pytest.raises(ValueError, match="not one default rope at every length"):
        source_rope_theta()(rotary, lambda rope, n: rope(torch.zeros(1, n, 1)), LENGTH, HEAD_DIM)
