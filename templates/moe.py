"""vLLM-side members of a mixture-of-experts causal LM (vLLM 0.32's ``MixtureOfExperts``).

Parsed with libcst by ``passes/fuse_experts.py``, never imported at run time. The pass
renames ``TemplateSparseMoeBlock`` to the model's MoE block class and ``TemplateDecoderLayer``
to its decoder layer, ``mlp``/``experts``/``layers`` to the attribute names the plan found,
splices ``__init__``'s statements into the causal LM's ``__init__`` and adds the method.
Follows vLLM's own ``qwen3_moe.py``.
"""

import torch
from torch import nn
from vllm.model_executor.models.utils import PPMissingLayer


class TemplateMoeForCausalLM(nn.Module):
    def __init__(self) -> None:
        # Expert-parallel load balancing (EPLB) bookkeeping, read by vLLM.
        moe_blocks = [
            layer.mlp
            for layer in self.model.layers
            if not isinstance(layer, PPMissingLayer)
            and isinstance(layer.mlp, TemplateSparseMoeBlock)
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
            if isinstance(layer.mlp, TemplateSparseMoeBlock):
                block = layer.mlp
                block.n_local_physical_experts = num_local_physical_experts
                block.n_physical_experts = num_physical_experts
                block.n_redundant_experts = self.num_redundant_experts
                block.experts.update_expert_map()


TemplateSparseMoeBlock = nn.Module  # placeholder name, renamed by the pass


class GatedSharedExpert(nn.Module):
    """A shared expert scaled by the sigmoid of its own gate, handed whole to vLLM's MoE
    runner (which adds it to the routed experts' output), as vLLM's qwen2_moe.py builds its
    shared MLP with ``expert_gate``. Holds the block's own modules: the checkpoint names stay
    the block's."""

    def __init__(self, expert: nn.Module, gate: nn.Module) -> None:
        super().__init__()
        self.expert = expert
        self.gate = gate

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(hidden_states)[0]) * self.expert(hidden_states)
