"""The lm_head's kind is proven on the example run's values, and those values are real:
parameters the model's code leaves uninitialised are drawn, never memory garbage."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from hfrewrite.analyze.example_run import _empty_is_nan, initialise_empty
from hfrewrite.analyze.lm_head import L2_NORMALIZED, PLAIN, TRANSPOSED_WHEN_UNTIED, head_kind
from hfrewrite.analyze.plan import Refusal

CONFIG = types.SimpleNamespace(hidden_size=8, vocab_size=16)


class Head(nn.Module):
    def __init__(self, normalized: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 8) * 0.5)
        self.normalized = normalized

    def forward(self, x):
        w = nn.functional.normalize(self.weight) if self.normalized else self.weight
        return nn.functional.linear(x, w)


@pytest.mark.parametrize(("normalized", "kind"), [(False, PLAIN), (True, L2_NORMALIZED)])
def test_head_kind_on_values(normalized, kind):
    torch.manual_seed(0)
    head, x = Head(normalized), torch.randn(1, 3, 8)
    assert head_kind(head, x, head(x), CONFIG, None) == kind


def test_near_zero_head_input_proves_nothing():
    """Denormal inputs (an uninitialised final norm) made every kind match: refused now."""
    torch.manual_seed(0)
    head, x = Head(True), torch.randn(1, 3, 8) * 1e-40
    with pytest.raises(Refusal, match="all but zero"):
        head_kind(head, x, head(x), CONFIG, None)


def test_unit_rows_cannot_tell_the_kinds_apart():
    torch.manual_seed(0)
    head = Head(True)
    with torch.no_grad():
        head.weight.copy_(nn.functional.normalize(head.weight))
    x = torch.randn(1, 3, 8)
    with pytest.raises(Refusal, match="agree on the example's weight"):
        head_kind(head, x, head(x), CONFIG, None)


class ErnieHead(nn.Module):
    """ERNIE-4.5's LMHead: [vocab, hidden] when tied, [hidden, vocab] multiplied as it is when not."""

    def __init__(self, tied: bool, transposes: bool = True):
        super().__init__()
        self.tied, self.transposes = tied, transposes
        self.weight = nn.Parameter(torch.randn(16, 8) if tied or not transposes else torch.randn(8, 16))

    def forward(self, x):
        return x @ (self.weight.T if self.tied or not self.transposes else self.weight)


@pytest.mark.parametrize("tied", [True, False])
def test_a_head_transposed_when_untied_is_proven_both_ways(tied):
    torch.manual_seed(0)
    config = types.SimpleNamespace(hidden_size=8, vocab_size=16, tie_word_embeddings=tied)
    head, other, x = ErnieHead(tied), ErnieHead(not tied), torch.randn(1, 3, 8)
    assert head_kind(head, x, head(x), config, other) == TRANSPOSED_WHEN_UNTIED
    same = ErnieHead(not tied, transposes=False)  # the same layout both ways: plain
    plain = ErnieHead(tied, transposes=False)
    assert head_kind(plain, x, plain(x), config, same) == PLAIN


def test_a_head_normalised_one_way_only_is_refused():
    torch.manual_seed(0)
    config = types.SimpleNamespace(hidden_size=8, vocab_size=16, tie_word_embeddings=True)
    x = torch.randn(1, 3, 8)
    tied, untied = Head(False), Head(True)
    with pytest.raises(Refusal, match="plain logits when tied and l2_normalized ones when untied"):
        head_kind(tied, x, tied(x), config, untied)


class Norm(nn.Module):
    """Baichuan-13B's RMSNorm: ``torch.empty`` that no initialiser writes."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8))
        self.proj = nn.Linear(8, 8)


def test_uninitialised_parameters_are_drawn_and_initialised_ones_kept():
    empty, empty_like = torch.empty, torch.empty_like
    with _empty_is_nan():
        model = Norm()
    assert torch.isnan(model.weight).all()  # whatever memory held is NaN while building
    linear = model.proj.weight.detach().clone()
    initialise_empty(model)
    assert torch.isfinite(model.weight).all() and (model.weight - 1.0).abs().max() < 0.2
    assert torch.equal(model.proj.weight, linear)  # nn.Linear's own init wrote it
    assert torch.empty is empty and torch.empty_like is empty_like  # restored
    with _empty_is_nan():
        assert torch.empty(3, dtype=torch.long).dtype == torch.long  # integers untouched
