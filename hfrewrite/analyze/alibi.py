"""ALiBi (Baichuan-13B, BLOOM, Falcon-RW, MPT): attention by hand whose scores add a per-head
linear bias over key positions, proven on the values.

On the causal region, the traced scores minus ``q @ k^T * head_dim ** -0.5`` must change by
one slope per head from each key to the next (a row constant does not change the softmax);
the slopes must be the standard ALiBi slopes of the head count (``alibi_slopes``), times 1 or
times the scale (Falcon-RW adds the bias before scaling); and causal attention with that bias
must reproduce the traced output. vLLM's ``Attention(alibi_slopes=...)`` computes the same.
"""

from __future__ import annotations

import math

import torch

# How the proven slopes relate to the standard ones: the factor's expression in the
# attention class of the emitted file (``self.head_dim``), and its value
FACTORS = ("1.0", "self.head_dim**-0.5")


def alibi_slopes(total_num_heads: int) -> torch.Tensor:
    """The ALiBi paper's slopes (as BLOOM and Baichuan compute them), for any head count."""
    closest = 2 ** math.floor(math.log2(total_num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = torch.pow(torch.tensor(base, dtype=torch.float64), torch.arange(1, 1 + closest))
    if closest != total_num_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        remaining = min(closest, total_num_heads - closest)
        extra = torch.pow(
            torch.tensor(extra_base, dtype=torch.float64), torch.arange(1, 1 + 2 * remaining, 2)
        )
        slopes = torch.cat([slopes, extra])
    return slopes


def with_alibi(query, key, value, factor: float):
    """Causal attention of [b, h, s, d] q and (expanded) k, v with the standard slopes times
    ``factor``: [b, h, s, d]."""
    length, heads = query.shape[-2], query.shape[1]
    positions = torch.arange(length)
    slopes = (alibi_slopes(heads) * factor).to(query.dtype)
    bias = slopes[:, None, None] * (positions[None, None, :] - positions[None, :, None])
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    bias = bias.masked_fill(~causal, float("-inf"))
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=bias)


def proven_factor(qk, scores, query, key, value, out) -> str | None:
    """Which of ``FACTORS`` the traced scores' bias proves, or None (not ALiBi)."""
    s, raw = scores.double(), qk.double()
    length, d = s.shape[-1], query.shape[-1]
    if s.dim() != 4 or s.shape[-2] != length or length < 3:
        return None
    bias = s - raw * d**-0.5
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    pairs = causal[:, 1:] & causal[:, :-1]  # key j and j + 1 both visible
    steps = (bias[..., 1:] - bias[..., :-1])[..., pairs]  # [b, h, pairs]
    slopes = steps[0, :, :1]
    tol = 1e-5 * max(1.0, float((raw * d**-0.5).abs().max()))  # float32 scores: relative error
    if not torch.allclose(steps, slopes.expand_as(steps), rtol=1e-4, atol=tol):
        return None
    standard = alibi_slopes(query.shape[1])
    for expr, factor in zip(FACTORS, (1.0, d**-0.5)):
        if not torch.allclose(slopes[:, 0], standard * factor, rtol=1e-4, atol=1e-6):
            continue
        want = with_alibi(query, key, value, factor)  # [b, h, s, d], as the traced output
        if (
            torch.is_tensor(out)
            and out.shape == want.shape
            and torch.allclose(out, want, rtol=1e-4, atol=1e-5)
        ):
            return expr
    return None
