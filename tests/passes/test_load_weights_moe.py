"""load_weights: HF checkpoint names mapped onto the fused shards."""

from harness import rewrite
from hfrewrite.passes import load_weights
from plans import qwen_moe

BEFORE_MOE_KEYS_QUALIFIED_BY_MLP_SITES = """\
class MoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.shared_expert = Qwen3MoeMLP(config)


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        if layer_idx in config.mlp_only_layers:
            self.mlp = Qwen3MoeMLP(config)
        else:
            self.mlp = MoeBlock(config)


class Qwen3MoeForCausalLM(nn.Module, SupportsLoRA, SupportsPP):
    def load_weights(self, weights):
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)
"""

AFTER_MOE_KEYS_QUALIFIED_BY_MLP_SITES = """\
class MoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.shared_expert = Qwen3MoeMLP(config)


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        if layer_idx in config.mlp_only_layers:
            self.mlp = Qwen3MoeMLP(config)
        else:
            self.mlp = MoeBlock(config)


class Qwen3MoeForCausalLM(nn.Module, SupportsLoRA, SupportsPP):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    # Hugging Face checkpoints keep the fused projections apart: each tensor is
    # loaded into its shard (weight_name: (param_name, shard_id)); per-expert and stacked
    # expert tensors go to the fused-MoE loader as they are.
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
            ".mlp.gate_proj": (".mlp.gate_up_proj", 0),
            ".mlp.up_proj": (".mlp.gate_up_proj", 1),
            ".shared_expert.gate_proj": (".shared_expert.gate_up_proj", 0),
            ".shared_expert.up_proj": (".shared_expert.gate_up_proj", 1),
        }
    )
    embedding_modules = {"embed_tokens": "input_embeddings", "lm_head": "output_embeddings"}
    
    def load_weights(self, weights):
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)
"""


def test_moe_keys_qualified_by_mlp_sites():
    assert (
        rewrite(load_weights, BEFORE_MOE_KEYS_QUALIFIED_BY_MLP_SITES, qwen_moe(shared=True))
        == AFTER_MOE_KEYS_QUALIFIED_BY_MLP_SITES
    )
