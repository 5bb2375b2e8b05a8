"""analyze/gated_delta_net.py: a block is vLLM's QwenGatedDeltaNetAttention only when its
formula replays it, and when the config attributes vLLM's class reads are the ones the
block's own __init__ sizes it with."""

from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from hfrewrite.analyze.gated_delta_net import NOT_A_GDN, analyze_gated_delta_net
from hfrewrite.analyze.mixers import analyze_mixer
from hfrewrite.analyze.plan import GatedDeltaNetPlan, NoMatch

SIZES = {
    "hidden_size": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
}


def _config(**changes) -> transformers.Qwen3_5TextConfig:
    return transformers.Qwen3_5TextConfig(**{**SIZES, **changes})


def _layer(block: nn.Module) -> nn.Module:
    layer = nn.Module()
    layer.linear_attn = block
    return layer


def _block(config=None) -> nn.Module:
    torch.manual_seed(0)
    block = Qwen3_5GatedDeltaNet(config or _config(), layer_idx=0)
    with torch.no_grad():  # past the init's ones, so that a mixed-up dt_bias or norm shows
        for param in (block.dt_bias, block.norm.weight):
            param.normal_(1.0, 0.3)
    return block


def test_qwen35s_gated_delta_net_is_vllms():
    plan = analyze_gated_delta_net(_layer(_block()), "linear_attn", _config())
    assert isinstance(plan, GatedDeltaNetPlan), plan
    assert (plan.module_class, plan.attr, plan.vllm_dtype) == (
        "Qwen3_5GatedDeltaNet",
        "linear_attn",
        "bfloat16",
    )
    assert [condition for condition, _ in plan.fixed] == [
        'config.hidden_act in ("silu", "swish")',
        'getattr(config, "output_gate_type", "silu") in ("silu", "swish")',
    ]
    # the checkpoint's four projections load into vLLM's two fused ones
    assert plan.stacked_shards == (
        ("in_proj_qkvz", "in_proj_qkv", "(0, 1, 2)"),
        ("in_proj_qkvz", "in_proj_z", "3"),
        ("in_proj_ba", "in_proj_b", "0"),
        ("in_proj_ba", "in_proj_a", "1"),
    )
    assert isinstance(analyze_mixer(_layer(_block()), "linear_attn", _config()), GatedDeltaNetPlan)


def test_a_block_computing_otherwise_is_refused_by_the_replay():
    block = _block()
    block.norm.activation = "sigmoid"  # its gate is not the silu vLLM's layer applies
    plan = analyze_gated_delta_net(_layer(block), "linear_attn", _config())
    assert isinstance(plan, NoMatch) and plan.reason.startswith("replaying vLLM's gated delta net differs by")


def test_key_heads_vllm_would_read_otherwise_are_refused():
    # the block was built with 2 key heads of 16; a config saying 4 of 8 sizes the same
    # width, and vLLM's layer, reading it, would group the value heads otherwise
    config = _config()
    block = _block(config)
    config.linear_num_key_heads, config.linear_key_head_dim = 4, 8
    plan = analyze_gated_delta_net(_layer(block), "linear_attn", config)
    assert isinstance(plan, NoMatch) and "replaying vLLM's gated delta net differs" in plan.reason, plan


def test_a_config_its_block_was_not_built_from_is_refused():
    config = _config()
    block = _block(config)
    config.linear_value_head_dim = 16
    plan = analyze_gated_delta_net(_layer(block), "linear_attn", config)
    assert isinstance(plan, NoMatch) and "config.linear_value_head_dim is 16" in plan.reason, plan


def test_other_blocks_are_no_gated_delta_net():
    layer = nn.Module()
    layer.linear_attn = nn.Linear(4, 4)
    assert analyze_gated_delta_net(layer, "linear_attn", _config()).reason == NOT_A_GDN


def test_qwen3_nexts_interleaved_projections_are_vllms_interleaved_layout():
    """Qwen3-Next keeps q, k, v, z and b, a in two projections interleaved per key head: the
    replay takes them apart as vLLM's gqa_interleaved_layout does; nothing to stack at load."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = transformers.Qwen3NextConfig(**SIZES)
    torch.manual_seed(0)
    block = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    plan = analyze_gated_delta_net(_layer(block), "linear_attn", config)
    assert isinstance(plan, GatedDeltaNetPlan) and plan.interleaved, plan
    assert plan.stacked_shards == ()


def test_interleaved_replay_differs_from_the_flat_reading():
    """Read as Qwen3.5's flat layout (q, k, v, z one after another), Qwen3-Next's
    interleaved projection gives another output: the layouts are told apart on values."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from hfrewrite.analyze import gated_delta_net

    config = transformers.Qwen3NextConfig(**SIZES)
    torch.manual_seed(0)
    block = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    sizes = {
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": config.linear_conv_kernel_dim,
        "rms_norm_eps": config.rms_norm_eps,
    }
    hidden = torch.randn(1, 5, 64)
    with torch.no_grad():
        want = block(hidden)
        interleaved = gated_delta_net.reference(block, hidden, sizes, "interleaved")
        qkvz, ba = block.in_proj_qkvz, block.in_proj_ba
        flat = nn.Module()
        flat.in_proj_qkv = nn.Linear(64, 96, bias=False)  # q, k: 2 heads of 16; v: 4 of 8
        flat.in_proj_z = nn.Linear(64, 32, bias=False)
        flat.in_proj_b, flat.in_proj_a = nn.Linear(64, 4, bias=False), nn.Linear(64, 4, bias=False)
        flat.in_proj_qkv.weight.copy_(qkvz.weight[:96])
        flat.in_proj_z.weight.copy_(qkvz.weight[96:])
        flat.in_proj_b.weight.copy_(ba.weight[:4])
        flat.in_proj_a.weight.copy_(ba.weight[4:])
        for part in ("conv1d", "norm", "out_proj"):
            flat.add_module(part, block.get_submodule(part))
        flat.A_log, flat.dt_bias = block.A_log, block.dt_bias
        misread = gated_delta_net.reference(flat, hidden, sizes)
    assert torch.allclose(want, interleaved, atol=1e-5)
    assert not torch.allclose(want, misread, atol=1e-3)


def _olmo(**changes):
    from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridGatedDeltaNet

    config = transformers.OlmoHybridConfig(**{**SIZES, "linear_value_head_dim": 24, **changes})
    torch.manual_seed(0)
    block = OlmoHybridGatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():
        for param in (block.dt_bias, block.o_norm.weight):
            param.normal_(1.0, 0.3)
    return block, config


def test_olmo_hybrids_gated_delta_net_is_vllms_olmo_layer():
    """OLMo-hybrid keeps q, k, v, the gate g, b and a apart, and doubles beta where the config
    allows negative eigenvalues: vLLM's OlmoHybridGatedDeltaNetAttention, both values of
    the switch replayed, the checkpoint's convolutions taken from transformers' table."""
    block, config = _olmo()
    assert config.linear_allow_neg_eigval is True
    plan = analyze_gated_delta_net(_layer(block), "linear_attn", config)
    assert isinstance(plan, GatedDeltaNetPlan), plan
    assert (plan.layout, plan.vllm_dtype, plan.stacked_scope) == ("olmo", "float32", "linear_attn")
    # the switch is proven for both values: the file need not pin it
    assert [condition for condition, _ in plan.fixed] == ['config.hidden_act in ("silu", "swish")']
    assert plan.stacked_shards == (
        ("in_proj_qkvg", "q_proj", "0"),
        ("in_proj_qkvg", "k_proj", "1"),
        ("in_proj_qkvg", "v_proj", "2"),
        ("in_proj_qkvg", "g_proj", "3"),
        ("conv1d", "q_conv1d", "0"),
        ("conv1d", "k_conv1d", "1"),
        ("conv1d", "v_conv1d", "2"),
    )


def test_an_olmo_block_not_doubling_beta_as_its_config_says_is_refused():
    block, config = _olmo()
    block.allow_neg_eigval = False  # the config says True: vLLM's layer would double beta
    plan = analyze_gated_delta_net(_layer(block), "linear_attn", config)
    assert isinstance(plan, NoMatch) and plan.reason.startswith("replaying vLLM's gated delta net differs"), (
        plan
    )


def test_an_olmo_norm_epsilon_other_than_vllms_fixed_one_is_refused():
    block, config = _olmo()
    block.o_norm.variance_epsilon = 1e-6  # vLLM's OLMo layer builds its norm with 1e-5 whatever
    plan = analyze_gated_delta_net(_layer(block), "linear_attn", config)
    assert isinstance(plan, NoMatch) and "where vLLM's layer takes 1e-05" in plan.reason, plan


def test_concatenated_sources_read_transformers_table():
    from hfrewrite.analyze.checkpoint import concatenated_sources

    assert concatenated_sources("olmo_hybrid", "linear_attn.conv1d.weight") == (
        "q_conv1d",
        "k_conv1d",
        "v_conv1d",
    )
    assert concatenated_sources("olmo_hybrid", "mamba.conv1d.weight") == ()
    assert concatenated_sources("qwen3_5_text", "linear_attn.conv1d.weight") == ()
