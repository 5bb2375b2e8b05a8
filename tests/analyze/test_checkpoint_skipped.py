"""analyze/checkpoint.py: the checkpoint prefixes transformers' causal LM declares it never
loads (``_keys_to_ignore_on_load_unexpected``), which the file's load_weights skips too."""

from __future__ import annotations

import dataclasses

import libcst as cst
from transformers import DeepseekV3ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3NextForCausalLM

from hfrewrite.analyze.checkpoint import unexpected_prefixes
from hfrewrite.emit.weight_streams import base_model_names
from tests.passes.plans import llama_like


def test_multi_token_prediction_layers_are_skipped_prefixes():
    # the classes' own declarations, read without building a model
    assert unexpected_prefixes(Qwen3NextForCausalLM.__new__(Qwen3NextForCausalLM)) == ("mtp",)
    model = Qwen3_5ForConditionalGeneration.__new__(Qwen3_5ForConditionalGeneration)
    assert unexpected_prefixes(model) == ("mtp",)

    class Escaped:  # escaped dots read as the plain prefix
        _keys_to_ignore_on_load_unexpected = (r"^mtp.*", r"^model\.visual.*", "attn.bias")

    assert unexpected_prefixes(Escaped()) == ("mtp", "model.visual")
    # a pattern that is no plain prefix (DeepSeek-V3's `model\\.layers\\.61.*`, unanchored) is not one
    assert unexpected_prefixes(DeepseekV3ForCausalLM.__new__(DeepseekV3ForCausalLM)) == ()


def test_load_weights_leaves_them_unprefixed_and_ignores_them():
    plan = dataclasses.replace(
        llama_like(), checkpoint_roots=("model", "lm_head"), checkpoint_skipped=("mtp",)
    )
    method = cst.parse_module(
        "def load_weights(self, weights):\n"
        "    loader = AutoWeightsLoader(self)\n"
        "    return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)\n"
    ).body[0]
    code = cst.Module(body=base_model_names([method], plan)).code
    assert 'if not name.startswith(("model.", "lm_head.", "mtp")):' in code
    assert 'loader = AutoWeightsLoader(self, ignore_unexpected_prefixes=["mtp"])' in code
    assert "loader.load_weights(self._base_model_names(weights), mapper=self.hf_to_vllm_mapper)" in code
