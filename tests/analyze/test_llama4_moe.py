"""Llama-4's MoE blocks, on the installed transformers' own classes: every expert runs on every
token's input scaled by its routing weight (analyze/input_weighted_moe.py), which vLLM's fused
MoE computes with ``apply_router_weight_on_input``, for one expert per token. Around it: the
decoder layer's ``mlp_out.view(residual.shape)`` is no obstacle to the fused residual norms,
the weightless L2 q/k norm stays the source's while the layer norms become vLLM's, and the
per-layer switch between dense and MoE layers is proven on both kinds of layer."""

import dataclasses

import pytest
import torch
import transformers
from transformers.models.llama4.modeling_llama4 import Llama4TextExperts, Llama4TextMoe

from hfrewrite.analyze.expert_layouts import ExpertLayout
from hfrewrite.analyze.model import analyze
from hfrewrite.analyze.moe_modules import int_attr
from hfrewrite.analyze.moe_replay import replay_error
from hfrewrite.analyze.router_scorings import Scoring
from hfrewrite.analyze.shrink import shrink_config
from hfrewrite.errors import HfrewriteError


@pytest.fixture(scope="module")
def plan():
    return analyze(transformers.AutoConfig.for_model("llama4_text"))


def test_the_released_layout_weights_the_chosen_experts_input(plan):
    moe = plan.moe
    assert moe.weights_on_input
    assert (moe.scoring, moe.renormalize, moe.top_k) == (Scoring.SIGMOID, False, 2)  # traced top-2
    assert moe.experts_layout is ExpertLayout.TRANSPOSED  # gate_up_proj [E, H, 2I]
    assert (moe.router, moe.experts, moe.shared_expert, moe.output_index) == (
        "router",
        "experts",
        "shared_expert",
        0,
    )


def test_the_layer_fuses_its_residual_norms_past_the_view_back_to_the_residual_shape(plan):
    assert [b.block for b in plan.decoder_layer.blocks] == ["self_attn", "feed_forward"]
    assert plan.norm is not None and plan.norm.module_class == "Llama4TextRMSNorm"
    assert plan.attention.q_norm == "qk_norm"  # the weightless L2 norm: the source's own class


def test_the_switch_between_dense_and_moe_layers_is_proven_both_ways(plan):
    assert not [s for s in plan.forward_switches if "moe_layers" in s[1]]
    assert plan.mlp is not None and plan.mlp.module_class == "Llama4TextMLP"


def test_a_config_choosing_two_experts_per_token_is_refused():
    config = transformers.AutoConfig.for_model("llama4_text", num_experts_per_tok=2)
    with pytest.raises(HfrewriteError) as refused:
        analyze(config)
    assert (
        "config.num_experts_per_tok is 2: vLLM's fused MoE weights the experts' input for one expert per token only"
        in str(refused.value)
    )


def test_weights_on_the_experts_output_do_not_replay_the_block(plan):
    config = shrink_config(transformers.AutoConfig.for_model("llama4_text"))
    torch.manual_seed(0)
    block = Llama4TextMoe(config)
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    x = torch.randn(1, 6, config.hidden_size)
    assert replay_error(block, plan.moe, x) is None
    assert replay_error(block, dataclasses.replace(plan.moe, weights_on_input=False), x) is not None


def test_an_attribute_assigned_from_another_is_not_a_second_holder_of_its_size():
    experts = Llama4TextExperts(shrink_config(transformers.AutoConfig.for_model("llama4_text")))
    assert experts.expert_dim == experts.intermediate_size
    assert int_attr(experts, experts.intermediate_size) == "intermediate_size"
