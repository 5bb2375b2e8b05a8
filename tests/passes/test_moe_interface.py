"""moe_interface: vLLM's MixtureOfExperts on the causal LM of a MoE model."""

from harness import assert_rewrites, rewrite
from hfrewrite.passes import moe_interface
from plans import llama_like, qwen_moe

BEFORE_QWEN3_MOE_CAUSAL_LM = """\
class Qwen3MoeForCausalLM(nn.Module, SupportsLoRA, SupportsPP):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        self.model = Qwen3MoeModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
"""

AFTER_QWEN3_MOE_CAUSAL_LM = """\
class Qwen3MoeForCausalLM(nn.Module, SupportsLoRA, SupportsPP, MixtureOfExperts):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        self.model = Qwen3MoeModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))

        # Expert-parallel load balancing (EPLB) bookkeeping, read by vLLM.
        moe_blocks = [
            layer.mlp
            for layer in self.model.layers
            if not isinstance(layer, PPMissingLayer)
            and isinstance(layer.mlp, MoeBlock)
        ]
        self.moe_layers = [block.experts for block in moe_blocks]
        # No sparse layer here (a configuration that makes every layer dense, or a pipeline
        # stage without one): vLLM then treats the model as dense.
        self.num_moe_layers = len(self.moe_layers)
        self.num_expert_groups = 1
        self.num_shared_experts = 0
        if moe_blocks:
            example = moe_blocks[0]
            self.num_logical_experts = example.n_logical_experts
            self.num_physical_experts = example.n_physical_experts
            self.num_local_physical_experts = example.n_local_physical_experts
            self.num_routed_experts = example.n_routed_experts
            self.num_redundant_experts = example.n_redundant_experts
    
    def update_physical_experts_metadata(
        self, num_physical_experts: int, num_local_physical_experts: int
    ) -> None:
        assert self.num_local_physical_experts == num_local_physical_experts
        self.num_physical_experts = num_physical_experts
        self.num_local_physical_experts = num_local_physical_experts
        self.num_redundant_experts = num_physical_experts - self.num_logical_experts
        for layer in self.model.layers:
            if isinstance(layer, PPMissingLayer):
                continue
            if isinstance(layer.mlp, MoeBlock):
                block = layer.mlp
                block.n_local_physical_experts = num_local_physical_experts
                block.n_physical_experts = num_physical_experts
                block.n_redundant_experts = self.num_redundant_experts
                block.experts.update_expert_map()
"""


def test_qwen3_moe_causal_lm():
    assert_rewrites(moe_interface, BEFORE_QWEN3_MOE_CAUSAL_LM, AFTER_QWEN3_MOE_CAUSAL_LM, qwen_moe())


def test_dense_model_is_left_alone():
    dense = BEFORE_QWEN3_MOE_CAUSAL_LM.replace("Qwen3Moe", "Llama")
    assert_rewrites(moe_interface, dense, dense, llama_like())


def test_expert_groups_are_the_count_the_block_hands_its_runner():
    block = """\
class MoeBlock(nn.Module):
    def __init__(self, config):
        self.experts = FusedMoEFactory(num_experts=8, use_grouped_topk=True, num_expert_group=config.n_group)
"""
    after = rewrite(moe_interface, block + "\n\n" + BEFORE_QWEN3_MOE_CAUSAL_LM, qwen_moe())
    assert "self.num_expert_groups = config.n_group\n" in after
    assert "self.num_expert_groups = 1\n" not in after
