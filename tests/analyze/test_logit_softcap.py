"""The final-logit soft cap is proven by running the model with its config field changed:
a cap read from the config when the model runs is the field; a constant, a value copied at
build time, or a cap that fails at None is not."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hfrewrite.analyze.logit_softcap import softcap_field
from hfrewrite.analyze.shrink import VOCAB


class Config:
    def __init__(self, **fields):
        self.__dict__.update(fields)


class Capped(nn.Module):
    """A causal LM whose logits are capped the way ``style`` says."""

    def __init__(self, style: str):
        super().__init__()
        torch.manual_seed(0)
        self.config = Config(final_logit_softcapping=30.0, rms_norm_eps=1e-6, initializer_range=0.02)
        self.style = style
        self.embed = nn.Embedding(VOCAB, 8)
        self.lm_head = nn.Linear(8, VOCAB, bias=False)
        self.frozen_cap = self.config.final_logit_softcapping

    def forward(self, input_ids, use_cache=False):
        logits = self.lm_head(self.embed(input_ids) * 100)  # logits large enough to be capped
        cap = {
            "runtime": self.config.final_logit_softcapping,
            "constant": 30.0,
            "frozen": self.frozen_cap,
            "unguarded": self.config.final_logit_softcapping,
        }[self.style]
        if cap is not None or self.style == "unguarded":
            logits = torch.tanh(logits / cap) * cap
        return SimpleNamespace(logits=logits)


def test_a_cap_read_from_the_config_is_its_field():
    model = Capped("runtime")
    assert softcap_field(model, "lm_head") == "final_logit_softcapping"
    assert model.config.final_logit_softcapping == 30.0  # restored


@pytest.mark.parametrize(
    ("style", "why"),
    [
        ("constant", "the cap does not follow the field"),
        ("frozen", "the value was copied when the model was built"),
        ("unguarded", "the source fails where the field is None"),
    ],
)
def test_other_caps_are_not_proven(style, why):
    model = Capped(style)
    assert softcap_field(model, "lm_head") is None, why
    assert model.config.final_logit_softcapping == 30.0


def test_a_scale_is_not_a_cap():
    model = Capped("runtime")
    model.forward = lambda input_ids, use_cache=False: SimpleNamespace(
        logits=model.lm_head(model.embed(input_ids)) * model.config.final_logit_softcapping
    )
    assert softcap_field(model, "lm_head") is None
