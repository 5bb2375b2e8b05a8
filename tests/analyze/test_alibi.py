"""ALiBi proven on values: the standard slopes, the factor, and what is not ALiBi."""

from __future__ import annotations

import pytest
import torch

from hfrewrite.analyze.alibi import FACTORS, alibi_slopes, proven_factor, with_alibi


def test_the_standard_slopes():
    # a power of two: 2^(-8/n * i); otherwise every other slope of the next power of two follows
    assert torch.allclose(
        alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)], dtype=torch.float64)
    )
    six = alibi_slopes(6)
    assert torch.allclose(six[:4], alibi_slopes(4)) and torch.allclose(six[4:], alibi_slopes(8)[0::2][:2])


def _scores(q, k, bias):
    return q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + bias


def _traced(factor: float, heads: int = 4, length: int = 6, extra=0.0):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, heads, length, 32, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(length)
    slopes = alibi_slopes(heads) * factor
    bias = slopes[:, None, None] * (pos[None, None, :] + extra * pos[None, None, :] ** 2)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    scores = _scores(q, k, bias).masked_fill(~causal, float("-inf"))
    out = torch.softmax(scores, -1) @ v
    return q @ k.transpose(-1, -2), scores, q, k, v, out


@pytest.mark.parametrize(("factor", "expr"), [(1.0, FACTORS[0]), (32**-0.5, FACTORS[1])])
def test_a_bias_by_key_position_is_alibi_whatever_the_row_constant(factor, expr):
    qk, scores, q, k, v, out = _traced(factor)
    assert proven_factor(qk, scores, q, k, v, out) == expr
    assert torch.allclose(with_alibi(q, k, v, factor), out)


def test_other_biases_are_not_alibi():
    assert proven_factor(*_traced(0.5)) is None  # slopes that are not the standard ones
    assert proven_factor(*_traced(1.0, extra=0.1)) is None  # not linear in the key position
    assert proven_factor(*_traced(0.0)) is None  # no bias at all: plain causal attention
