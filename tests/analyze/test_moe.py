"""MoE analysis: the facts found for the four families, and refusals that keep it closed."""

import re

import pytest
import transformers
from transformers.models.qwen3_moe import modeling_qwen3_moe as qm

from hfrewrite.analyze.expert_layouts import ExpertLayout
from hfrewrite.analyze.model import analyze
from hfrewrite.analyze.router_scorings import Scoring
from hfrewrite.errors import HfrewriteError


def plan(model_type, **overrides):
    return analyze(transformers.AutoConfig.for_model(model_type, **overrides))


def test_qwen3_moe_router_facts():
    p = plan("qwen3_moe", norm_topk_prob=True)
    moe = p.moe
    assert (moe.module_class, moe.router, moe.experts) == (
        "Qwen3MoeSparseMoeBlock",
        "gate",
        "experts",
    )
    assert (moe.scoring, moe.renormalize, moe.top_k, moe.activation) == (
        Scoring.SOFTMAX,
        True,
        2,
        "silu",
    )
    assert moe.shared_expert is None and moe.checkpoint_expert_names == (
        "gate_proj",
        "down_proj",
        "up_proj",
    )
    assert p.mlp.module_class == "Qwen3MoeMLP"  # traced through a dense layer of the shrunk config


def test_renormalisation_is_traced_on_whatever_the_config_says():
    # The shrunk config turns it on, so the replay proves the division the source guards
    # with `if self.norm_topk_prob`; the emitted file keeps that condition.
    assert plan("qwen3_moe", norm_topk_prob=False).moe.renormalize is True


def test_mixtral_checkpoint_layout_comes_from_transformers_conversion_table():
    moe = plan("mixtral").moe
    assert moe.renormalize is True and moe.checkpoint_expert_names == ("w1", "w2", "w3")
    assert moe.checkpoint_renames == ((".block_sparse_moe.", ".mlp."),)


def test_qwen2_moe_shared_expert_and_its_sigmoid_gate():
    p = plan("qwen2_moe")
    assert (p.moe.shared_expert, p.moe.shared_expert_gate) == (
        "shared_expert",
        "shared_expert_gate",
    )
    assert p.mlp.module_class == "Qwen2MoeMLP"


def test_olmoe_norms_over_all_heads():
    assert plan("olmoe").attention.qk_norm_over == "all_heads"


# One change to the qwen3_moe source each ((class, method, (old, new)), ...), and the
# refusal it must give. (Router changes: test_routing.py.)
BLOCK_RETURN = "return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)"
REFUSALS = {
    "gate_up halves swapped": (
        [
            (
                qm.Qwen3MoeExperts,
                "forward",
                (".chunk(2, dim=-1)", ".chunk(2, dim=-1)[::-1]"),
            )
        ],
        "Qwen3MoeSparseMoeBlock: fuse_experts: replaying the plan",
    ),
    "a block returning a tuple, the layer using both": (
        [
            (
                qm.Qwen3MoeSparseMoeBlock,
                "forward",
                (BLOCK_RETURN, f"{BLOCK_RETURN}, final_hidden_states.sum()"),
            ),
            (
                qm.Qwen3MoeDecoderLayer,
                "forward",
                (
                    "hidden_states = self.mlp(hidden_states)",
                    "hidden_states, aux = self.mlp(hidden_states)\n        hidden_states = hidden_states + 0.1 * aux",
                ),
            ),
        ],
        "Qwen3MoeSparseMoeBlock: fuse_experts: the block returns more than one tensor",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_moe_mutations_are_refused(mutate, case):
    edits, reason = REFUSALS[case]
    for cls, method, edit in edits:
        mutate(cls, method, edit)
    with pytest.raises(HfrewriteError, match=re.escape(reason)):
        plan("qwen3_moe")


def test_interleaved_gate_up_converts_as_interleaved(mutate):
    # gate and up interleaved along 2I: the replay proves it, the loader splits it so
    mutate(qm.Qwen3MoeExperts, "forward", (".chunk(2, dim=-1)", ".unflatten(-1, (-1, 2)).unbind(-1)"))
    moe = plan("qwen3_moe").moe
    assert (moe.experts_layout, moe.activation, moe.experts_bias) == (ExpertLayout.INTERLEAVED, "silu", False)


def test_phimoe_sparsemixer_router_is_carried_and_proven_with_the_experts():
    moe = plan("phimoe").moe
    # No runner option expresses sparsemixer: the router module runs as the source has it,
    # its (weights, ids) outputs handed to the fused experts.
    assert (moe.router, moe.router_class, moe.carried_router) == (
        "router",
        "PhimoeTopKRouter",
        (1, 2),
    )
    assert (moe.scoring, moe.top_k, moe.grouped) == (Scoring.CARRIED, 2, False)
    assert moe.checkpoint_expert_names == ("w1", "w2", "w3")


def test_carried_router_still_needs_the_experts_replay(mutate):
    # A block that scales the experts' output after the fused call: the router is carried,
    # but the replay of router -> experts no longer reproduces the block.
    from transformers.models.phimoe import modeling_phimoe as pm

    mutate(pm.PhimoeSparseMoeBlock, "forward", (BLOCK_RETURN, f"{BLOCK_RETURN} * 1.5"))
    with pytest.raises(HfrewriteError, match="replaying the plan"):
        plan("phimoe")
