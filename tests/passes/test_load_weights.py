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
