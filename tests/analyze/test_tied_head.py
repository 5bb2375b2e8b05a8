"""The lm_head's tie target is found by weight identity on the model built tied (the
shrunk config with tie_word_embeddings flipped, when it is untied)."""

from __future__ import annotations

import types

from torch import nn

from hfrewrite.analyze.tied_head import flipped_tie, tied_target


class LM(nn.Module):
    def __init__(self, config, ties: bool):
        super().__init__()
        self.model = nn.Module()
        self.model.embed = nn.Embedding(8, 4)
        self.lm_head = nn.Linear(4, 8, bias=False)
        if ties and config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed.weight


def test_the_shared_weight_names_the_target():
    small = types.SimpleNamespace(tie_word_embeddings=False)
    tied = flipped_tie(small, lambda c: LM(c, ties=True))
    assert tied_target(tied, "lm_head") == "model.embed"
    assert small.tie_word_embeddings is False  # built from a copy


def test_no_shared_weight_no_tie():
    small = types.SimpleNamespace(tie_word_embeddings=False)
    assert tied_target(flipped_tie(small, lambda c: LM(c, ties=False)), "lm_head") is None


def test_a_model_that_cannot_build_tied_never_ties():
    def refuses(config):
        raise ValueError("tied heads are not supported")

    assert flipped_tie(types.SimpleNamespace(), refuses) is None
    assert tied_target(None, "lm_head") is None
