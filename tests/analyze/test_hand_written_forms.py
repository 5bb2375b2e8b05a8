"""Forms of hand-written custom code the analysis reads as what they compute: scores as an
einsum over ``[batch * heads]`` scaled before their per-head view (TeleChat), and q/k
assembled by slice writes into an empty tensor (DeepSeek-V3's Hub code). Each is checked
on the values: the rewritten graph computes what the module does."""

from __future__ import annotations

import operator

import torch
from torch import nn

from hfrewrite.analyze.manual_attention import fold_manual_attention
from hfrewrite.analyze.slice_writes import fold_slice_writes
from hfrewrite.analyze.trace import causal_sdpa, trace

B, H, S, D = 2, 4, 5, 8


class _EinsumScores(nn.Module):
    """q, k, v as [seq, batch * heads, dim]; scores by einsum, scaled, then viewed per head."""

    def __init__(self, scale: float = D**-0.5, equation: str = "bik,bkj->bij") -> None:
        super().__init__()
        self.scale, self.equation = scale, equation

    def forward(self, q, k, v, mask):
        scores = self.scale * torch.einsum(
            self.equation, q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2)
        )
        scores = scores.view(B, H, S, S)
        probs = torch.softmax(torch.masked_fill(scores, mask, torch.finfo(scores.dtype).min), dim=-1)
        out = torch.bmm(probs.view(B * H, S, S), v.transpose(0, 1))
        return out.view(B, H, S, D)


def _inputs():
    torch.manual_seed(0)
    q, k, v = (torch.randn(S, B * H, D) for _ in range(3))
    mask = ~torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S)
    return q, k, v, mask


def _leaves(traced):
    return [n for n in traced.graph.nodes if n.target is causal_sdpa]


def test_einsum_scores_scaled_before_the_view_fold_into_causal_attention():
    module, args = _EinsumScores(), _inputs()
    traced = trace(module, args)
    assert fold_manual_attention(traced) == 1
    (leaf,) = _leaves(traced)
    assert leaf.kwargs.get("scaling") is None  # the default scale, proven
    torch.testing.assert_close(traced.graph_module(*args), module(*args), rtol=1e-5, atol=1e-5)


def test_another_constant_scale_is_carried_on_the_leaf():
    module, args = _EinsumScores(scale=0.3), _inputs()
    traced = trace(module, args)
    assert fold_manual_attention(traced) == 1
    assert _leaves(traced)[0].kwargs["scaling"] == 0.3  # the attention analyses decide on it
    torch.testing.assert_close(traced.graph_module(*args), module(*args), rtol=1e-5, atol=1e-5)


def test_an_einsum_that_is_not_a_batched_product_is_not_attention():
    module, args = _EinsumScores(equation="bik,bkj->bji"), _inputs()  # the scores transposed
    traced = trace(module, args)
    assert fold_manual_attention(traced) == 0


class _WrittenQuery(nn.Module):
    """DeepSeek's Hub attention: q and k written into empty tensors, the rope part of k
    (one head) broadcast over the heads."""

    def forward(self, q_nope, q_pe, k_nope, k_pe):
        q = q_pe.new_empty(B, H, S, 2 * D)
        q[:, :, :, :D] = q_nope
        q[:, :, :, D:] = q_pe
        k = k_pe.new_empty(B, H, S, 2 * D)
        k[:, :, :, :D] = k_nope
        k[:, :, :, D:] = k_pe
        return q @ k.transpose(-1, -2)


def test_slice_writes_become_the_concatenation_they_build():
    torch.manual_seed(0)
    args = (
        torch.randn(B, H, S, D),
        torch.randn(B, H, S, D),
        torch.randn(B, H, S, D),
        torch.randn(B, 1, S, D),
    )
    module = _WrittenQuery()
    traced = trace(module, args)
    assert fold_slice_writes(traced) == 2
    nodes = list(traced.graph.nodes)
    assert not [n for n in nodes if n.target is operator.setitem]
    assert len([n for n in nodes if n.target is torch.cat]) == 2
    torch.testing.assert_close(traced.graph_module(*args), module(*args))


class _ReadBetweenWrites(nn.Module):
    def forward(self, a, b):
        x = a.new_empty(B, S, 2 * D)
        x[..., :D] = a
        first = x.sum()  # read before the last write: not a concatenation
        x[..., D:] = b
        return x * first


def test_a_tensor_read_between_its_writes_stays_as_written():
    args = (torch.randn(B, S, D), torch.randn(B, S, D))
    traced = trace(_ReadBetweenWrites(), args)
    assert fold_slice_writes(traced) == 0


class _FlatSoftmax(nn.Module):
    """XGLM: q, k, v as [batch * heads, seq, dim]; the mask added in a per-head view between two
    flat views, the softmax over the flat scores, the probabilities viewed per head (the
    weights its layer discards) and back."""

    def forward(self, q, k, v, mask):
        weights = torch.bmm(q, k.transpose(1, 2))
        weights = weights.view(B, H, S, S) + mask
        weights = torch.max(weights, torch.full((), torch.finfo(weights.dtype).min))
        weights = torch.softmax(weights.view(B * H, S, S), dim=-1)
        returned = weights.view(B, H, S, S)
        probs = returned.view(B * H, S, S)
        return torch.bmm(probs, v).view(B, H, S, D)


def test_a_softmax_over_flat_scores_folds_as_the_per_head_one():
    torch.manual_seed(0)
    q, k, v = (torch.randn(B * H, S, D) * D**-0.25 for _ in range(3))
    mask = torch.full((S, S), torch.finfo(torch.float32).min).triu(1).expand(B, 1, S, S)
    module = _FlatSoftmax()
    traced = trace(module, (q, k, v, mask))
    assert fold_manual_attention(traced) == 1
    torch.testing.assert_close(traced.graph_module(q, k, v, mask), module(q, k, v, mask))


class _FlatScoresPerHeadValues(nn.Module):
    """GPT-NeoX-Japanese's form: q and k flattened to [batch * heads, s, d], the scores a
    baddbmm on zeros at alpha 1/sqrt(d) viewed per head, the mask added, then a per-head
    ``probs @ v`` on v as [batch, heads, s, d]."""

    def forward(self, q, k, v, mask):
        qf, kf = q.reshape(B * H, S, D), k.reshape(B * H, S, D)
        zeros = torch.zeros(B * H, S, S, dtype=q.dtype)
        scores = torch.baddbmm(zeros, qf, kf.transpose(1, 2), beta=1.0, alpha=D**-0.5)
        scores = scores.view(B, H, S, -1) + mask
        return torch.matmul(torch.softmax(scores, dim=-1), v)


def test_flat_scores_meeting_per_head_values_fold_into_causal_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    mask = torch.full((S, S), float("-inf")).triu(1).expand(B, 1, S, S)
    module, args = _FlatScoresPerHeadValues(), (q, k, v, mask)
    traced = trace(module, args)
    assert fold_manual_attention(traced) == 1
    torch.testing.assert_close(traced.graph_module(*args), module(*args), rtol=1e-5, atol=1e-5)


def test_flat_scores_without_the_causal_mask_are_not_folded():
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    args = (q, k, v, torch.zeros(B, 1, S, S))  # every key seen: not causal
    assert fold_manual_attention(trace(_FlatScoresPerHeadValues(), args)) == 0


class _PerHeadMaskAndViews(nn.Module):
    """Falcon-RW's shape: scores viewed to their own shape, a mask of the scores' own shape
    (one per head) added, the probabilities viewed to their own shape before ``@ v``."""

    def forward(self, q, k, v, mask):
        scores = (q @ k.transpose(-1, -2)).view(B, H, S, S)
        probs = torch.softmax(scores * D**-0.5 + mask, dim=-1)
        return probs.view(B, H, S, S) @ v


def test_same_shape_views_and_a_per_head_mask_fold_into_causal_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    mask = torch.zeros(B, H, S, S).masked_fill(~causal, torch.finfo(torch.float32).min)
    module = _PerHeadMaskAndViews()
    traced = trace(module, (q, k, v, mask))
    assert fold_manual_attention(traced) == 1 and len(_leaves(traced)) == 1
