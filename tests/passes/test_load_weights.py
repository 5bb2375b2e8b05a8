"""load_weights: HF checkpoint names mapped onto the fused shards."""

import pytest
from harness import assert_rewrites, rewrite
from hfrewrite.passes import load_weights
from plans import llama_like

from hfrewrite.errors import HfrewriteError

BEFORE_LLAMA_CAUSAL_LM = """\
class LlamaForCausalLM(nn.Module, SupportsLoRA, SupportsPP):
    def load_weights(self, weights):
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)
"""

AFTER_LLAMA_CAUSAL_LM = """\
class LlamaForCausalLM(nn.Module, SupportsLoRA, SupportsPP):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    # Hugging Face checkpoints keep the fused projections apart: each tensor is
    # loaded into its shard (weight_name: (param_name, shard_id)).
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
            ".gate_proj": (".gate_up_proj", 0),
            ".up_proj": (".gate_up_proj", 1),
        }
    )
    embedding_modules = {"embed_tokens": "input_embeddings", "lm_head": "output_embeddings"}
    
    def load_weights(self, weights):
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)
"""


def test_llama_causal_lm():
    assert_rewrites(load_weights, BEFORE_LLAMA_CAUSAL_LM, AFTER_LLAMA_CAUSAL_LM, llama_like())


REFUSED_NO_MAPPER_USE = """\
class LlamaForCausalLM(nn.Module, SupportsLoRA, SupportsPP):
    def load_weights(self, weights):
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights, mapper=None)
"""


def test_refuses_no_mapper_use():
    with pytest.raises(HfrewriteError, match="hf_to_vllm_mapper"):
        rewrite(load_weights, REFUSED_NO_MAPPER_USE, llama_like())


def test_olmos_gated_delta_net_stacks_under_its_child_before_the_attentions_names():
    """OLMo-hybrid's gated delta net has q_proj, k_proj, v_proj as its attention layers do:
    its stacked names are qualified by the layer's child and mapped first (vLLM's mapper
    applies every stacked name a tensor's name holds, in order); transformers' substring
    renames are the mapper's; its three convolutions are joined and split again at load."""
    import dataclasses

    from hfrewrite.analyze.plan import GatedDeltaNetPlan

    gdn = GatedDeltaNetPlan(
        "OlmoHybridGatedDeltaNet",
        "linear_attn",
        layout="olmo",
        conv_sources=("q_conv1d", "k_conv1d", "v_conv1d"),
    )
    renames = (("attention_layer_norm", "input_layernorm"),)
    plan = dataclasses.replace(llama_like(), mixer=gdn, checkpoint_renames=renames)
    out = rewrite(load_weights, BEFORE_LLAMA_CAUSAL_LM, plan)
    stacked = out[out.index("orig_to_new_stacked") :]
    assert stacked.index('".linear_attn.q_proj": (".linear_attn.in_proj_qkvg", 0)') < stacked.index(
        '".q_proj": (".qkv_proj", "q")'
    )
    assert '".linear_attn.g_proj": (".linear_attn.in_proj_qkvg", 3)' in stacked
    assert '".linear_attn.v_conv1d": (".linear_attn.conv1d", 2)' in stacked
    assert '"attention_layer_norm": "input_layernorm"' in out
    assert '"in_proj_qkvg": ["q_proj", "k_proj", "v_proj", "g_proj"]' in out
    assert "self._concatenated_convs(weights)" in out and "joined.split(sizes)" in out
