"""Hugging Face's reference tokens for a model whose cache holds no attention layer.

transformers' ``generate`` cannot decode Bamba with Mamba-2 layers alone: its cache tracks no
sequence length without an attention layer. ``hf_greedy`` then takes the reference from full
recomputes (``use_cache=False``) at each step; any other error of ``generate`` still stops it.
"""

from __future__ import annotations

import pytest

from hfrewrite.verify import engine
from hfrewrite.verify.fixtures import DEFAULT_PROMPTS, make_tiny_checkpoint

MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 64, "mamba_d_state": 16, "mamba_chunk_size": 4}


@pytest.fixture(scope="module")
def mamba_only(tmp_path_factory):
    return make_tiny_checkpoint(
        "bamba", tmp_path_factory.mktemp("bamba"), num_hidden_layers=2, attn_layer_indices=[], **MAMBA
    )


def test_a_cache_without_attention_layers_falls_back_to_full_recomputes(mamba_only):
    prompts = DEFAULT_PROMPTS[:2]
    with pytest.raises(ValueError, match="only contain LinearAttention layers"):
        engine._generated(engine.hf_model(mamba_only), prompts, 4)
    tokens, logprobs = engine.hf_greedy(mamba_only, prompts, max_tokens=4)
    expected = engine.greedy_without_cache(engine.hf_model(mamba_only), prompts, 4)
    assert (tokens, logprobs) == expected and [len(t) for t in tokens] == [4, 4]


def test_any_other_error_of_generate_stops_it(mamba_only, monkeypatch):
    def broken(*args):
        raise ValueError("something else")

    monkeypatch.setattr(engine, "_generated", broken)
    with pytest.raises(ValueError, match="something else"):
        engine.hf_greedy(mamba_only, DEFAULT_PROMPTS[:1], max_tokens=2)
