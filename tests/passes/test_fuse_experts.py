"""fuse_experts: router + expert loop -> GateLinear + FusedMoEFactory."""

import pytest
from harness import assert_rewrites, rewrite
from hfrewrite.passes import fuse_experts
from plans import qwen_moe

from hfrewrite.errors import HfrewriteError

BEFORE_RENORMALISATION_CONDITION_FROM_SOURCE = """\
class TopKRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.hidden_dim = config.hidden_size

    def forward(self, hidden_states):
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
        return router_logits, router_top_value, router_indices


class Experts(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.act_fn = ACT2FN[config.hidden_act]


class MoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.experts = Experts(config)
        self.gate = TopKRouter(config)
        self.shared_expert = Qwen3MoeMLP(config, intermediate_size=config.shared_expert_intermediate_size)
        self.shared_expert_gate = torch.nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        _, routing_weights, selected_experts = self.gate(hidden_states)
        return self.experts(hidden_states, selected_experts, routing_weights).reshape(batch_size, sequence_length, hidden_dim)
"""

AFTER_RENORMALISATION_CONDITION_FROM_SOURCE = '''\
class TopKRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.hidden_dim = config.hidden_size

    def forward(self, hidden_states):
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
        return router_logits, router_top_value, router_indices


class Experts(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.act_fn = ACT2FN[config.hidden_act]


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


class MoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        # Expert parallelism and its load balancer (EPLB), as in vLLM's qwen3_moe.py;
        # the expert-parallel group exists where vLLM reads the config's expert count.
        vllm_config = get_current_vllm_config()
        parallel_config = vllm_config.parallel_config
        self.ep_size = (
            get_ep_group().device_group.size() if vllm_config.model_config.get_num_experts() else 1
        )
        self.n_routed_experts = config.num_experts
        self.n_logical_experts = self.n_routed_experts
        self.n_redundant_experts = parallel_config.eplb_config.num_redundant_experts
        self.n_physical_experts = self.n_logical_experts + self.n_redundant_experts
        self.n_local_physical_experts = self.n_physical_experts // self.ep_size
        self.gate = GateLinear(
            config.hidden_size,
            config.num_experts,
            prefix=f"{prefix}.gate",
        )
        self.shared_expert = Qwen3MoeMLP(config, intermediate_size=config.shared_expert_intermediate_size, reduce_results=False)
        self.shared_expert_gate = ReplicatedLinear(
            config.hidden_size,
            1,
            bias=False,
            quant_config=None,
            prefix=f"{prefix}.shared_expert_gate",
        )
        self.experts = FusedMoEFactory(
            gate=self.gate,
            shared_experts=GatedSharedExpert(self.shared_expert, self.shared_expert_gate),
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            renormalize=config.norm_topk_prob,
            enable_eplb=parallel_config.enable_eplb,
            num_redundant_experts=self.n_redundant_experts,
            activation=config.hidden_act,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        orig_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, orig_shape[-1])
        # vLLM's MoE runner applies the gate and adds the shared expert.
        final_hidden_states = self.experts(hidden_states=hidden_states, router_logits=hidden_states)
        return final_hidden_states.view(orig_shape)
'''


def test_renormalisation_condition_from_source():
    assert_rewrites(
        fuse_experts,
        BEFORE_RENORMALISATION_CONDITION_FROM_SOURCE,
        AFTER_RENORMALISATION_CONDITION_FROM_SOURCE,
        qwen_moe(shared=True),
    )


REFUSED_EXPERTS_NOT_BUILT_FROM_CONFIG = """\
class TopKRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.hidden_dim = config.hidden_size

    def forward(self, hidden_states):
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
        return router_logits, router_top_value, router_indices


class Experts(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.act_fn = ACT2FN[config.hidden_act]


class MoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.experts = Experts(other)
        self.gate = TopKRouter(config)
        self.shared_expert = Qwen3MoeMLP(config, intermediate_size=config.shared_expert_intermediate_size)
        self.shared_expert_gate = torch.nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        _, routing_weights, selected_experts = self.gate(hidden_states)
        return self.experts(hidden_states, selected_experts, routing_weights).reshape(batch_size, sequence_length, hidden_dim)
"""


def test_refuses_experts_not_built_from_config():
    with pytest.raises(HfrewriteError, match="is not Experts\\(config\\)"):
        rewrite(fuse_experts, REFUSED_EXPERTS_NOT_BUILT_FROM_CONFIG, qwen_moe(shared=True))


_CONDITIONAL_DIVISION = """\
        if self.norm_topk_prob:
            router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
"""


def test_refuses_a_traced_renormalisation_the_source_guards_with_no_division():
    source = BEFORE_RENORMALISATION_CONDITION_FROM_SOURCE.replace(
        _CONDITIONAL_DIVISION, "        if self.norm_topk_prob:\n            pass\n"
    )
    with pytest.raises(HfrewriteError, match="disagrees with the trace"):
        rewrite(fuse_experts, source, qwen_moe(shared=True))


def test_an_unconditional_router_the_replay_proved_renormalising_emits_true():
    # granitemoe: a softmax over the top-k logits has no division; the replay proved it.
    source = BEFORE_RENORMALISATION_CONDITION_FROM_SOURCE.replace(_CONDITIONAL_DIVISION, "")
    assert "renormalize=True," in rewrite(fuse_experts, source, qwen_moe(shared=True))


def test_refuses_a_router_of_another_class():
    source = REFUSED_EXPERTS_NOT_BUILT_FROM_CONFIG.replace("Experts(other)", "Experts(config)").replace(
        "self.gate = TopKRouter(config)", "self.gate = nn.Linear(config)"
    )
    with pytest.raises(HfrewriteError, match=r"self.gate is not TopKRouter\(config\)"):
        rewrite(fuse_experts, source, qwen_moe(shared=True))


def test_shared_expert_gate_positional_bias_is_read():
    source = BEFORE_RENORMALISATION_CONDITION_FROM_SOURCE.replace(
        "torch.nn.Linear(config.hidden_size, 1, bias=False)",
        "torch.nn.Linear(config.hidden_size, 1, False)",
    )
    after = rewrite(fuse_experts, source, qwen_moe(shared=True))
    assert (
        "self.shared_expert_gate = ReplicatedLinear(\n            config.hidden_size,\n            1,\n            bias=False,"
        in after
    )


_SHARED = "        self.shared_expert = Qwen3MoeMLP(config, intermediate_size=config.shared_expert_intermediate_size)\n"


def test_an_optional_shared_expert_keeps_its_condition_and_reaches_the_runner_as_none():
    source = BEFORE_RENORMALISATION_CONDITION_FROM_SOURCE.replace(
        _SHARED,
        "        self.shared_expert = None\n        if config.shared_expert_intermediate_size > 0:\n    "
        + _SHARED,
    )
    out = rewrite(fuse_experts, source, qwen_moe(shared=True))
    assert (
        "        if config.shared_expert_intermediate_size > 0:\n            self.shared_expert = Qwen3MoeMLP("
        in out
    )
    assert (
        "shared_experts=GatedSharedExpert(self.shared_expert, self.shared_expert_gate) "
        "if self.shared_expert is not None else None,"
    ) in out
    # the shared expert is built before the runner that takes it, and reduces with it
    assert out.index("self.shared_expert = Qwen3MoeMLP(") < out.index("self.experts = FusedMoEFactory(")
    assert "intermediate_size=config.shared_expert_intermediate_size, reduce_results=False)" in out


def test_refuses_an_init_that_builds_under_another_compound_statement():
    source = BEFORE_RENORMALISATION_CONDITION_FROM_SOURCE.replace(
        _SHARED, "        for _ in range(1):\n    " + _SHARED
    )
    with pytest.raises(HfrewriteError, match="builds under a `for` statement"):
        rewrite(fuse_experts, source, qwen_moe(shared=True))
