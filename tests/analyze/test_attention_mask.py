"""The mask each attention call is given is proven on the example run to be what vLLM's
``Attention`` computes: causal, within the call's sliding window where it passes one
(analyze/attention_options.py). A window the call does not pass, though the mask applies
it, is refused rather than converted into full causal attention."""

import pytest
import transformers

from hfrewrite.analyze.model import analyze
from hfrewrite.errors import HfrewriteError


def _mistral(window: int):
    config = transformers.AutoConfig.for_model("mistral")
    config.sliding_window = window
    return config


def test_a_window_shorter_than_the_example_is_proven_on_the_mask():
    assert analyze(_mistral(3)).attention.sliding_window == 3


def test_a_mask_window_the_call_does_not_pass_is_refused(monkeypatch):
    # Llama's attention passes no window; its base model made to build a sliding mask
    from transformers import masking_utils
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama, "create_causal_mask", masking_utils.create_sliding_window_causal_mask)
    config = transformers.AutoConfig.for_model("llama")
    config.sliding_window = 3
    with pytest.raises(HfrewriteError, match="the mask the attention call is given is not causal"):
        analyze(config)
