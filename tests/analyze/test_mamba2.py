"""analyze/mamba2.py: a block is vLLM's MambaMixer2 only when its formula replays it, built
from the config expressions the block's own __init__ sizes it with."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from transformers.models.bamba.modeling_bamba import BambaMixer, BambaRMSNormGated

from hfrewrite.analyze.mamba2 import NOT_A_MAMBA2, analyze_mamba2, init_expressions
from hfrewrite.analyze.mixers import analyze_mixer
from hfrewrite.analyze.plan import Mamba2Plan, NoMatch

SIZES = {"hidden_size": 64, "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 8, "mamba_chunk_size": 3}


def _config(**changes) -> transformers.BambaConfig:
    return transformers.BambaConfig(**{**SIZES, **changes})


def _layer(block: nn.Module) -> nn.Module:
    layer = nn.Module()
    layer.mamba = block
    return layer


def _bamba_block(config=None) -> nn.Module:
    torch.manual_seed(0)
    block = BambaMixer(config or _config(), layer_idx=0)
    with torch.no_grad():  # past the init's ones, so that a mixed-up D or dt_bias shows
        for param in (block.A_log, block.D, block.dt_bias, block.norm.weight):
            param.normal_(1.0, 0.3)
    return block


def test_bambas_mixer_is_vllms_with_its_configs_expressions():
    plan = analyze_mamba2(_layer(_bamba_block()), "mamba", _config())
    assert isinstance(plan, Mamba2Plan), plan
    assert dict(plan.args) == {
        "hidden_size": "config.hidden_size",
        "conv_kernel_size": "config.mamba_d_conv",
        "intermediate_size": "int(config.mamba_expand * config.hidden_size)",
        "use_conv_bias": "config.mamba_conv_bias",
        "use_bias": "config.mamba_proj_bias",
        "num_heads": "config.mamba_n_heads",
        "head_dim": "config.mamba_d_head",
        "rms_norm_eps": "config.rms_norm_eps",
        "activation": "config.hidden_act",
        "n_groups": "config.mamba_n_groups",
        "ssm_state_size": "config.mamba_d_state",
    }
    # the time-step limits vLLM does not clamp to stay off; one traced group is all that is proven
    assert [condition for condition, _ in plan.fixed] == [
        'tuple(config.time_step_limit) == (0.0, float("inf"))',
        'config.hidden_act in ("silu", "swish")',
        "config.mamba_n_groups == 1",
    ]


def test_bambas_norm_over_all_channels_is_kept_with_two_groups():
    """Bamba's gated norm spans every channel; vLLM's norms each group's: with two groups only
    the formula with one norm group replays it, and the file's mixer keeps that norm."""
    config = _config(mamba_n_groups=2)
    plan = analyze_mamba2(_layer(_bamba_block(config)), "mamba", config)
    assert isinstance(plan, Mamba2Plan) and plan.norm_spans_groups, plan
    assert "config.mamba_n_groups == 1" not in [condition for condition, _ in plan.fixed]


def test_another_difference_with_two_groups_is_not_blamed_on_the_norm():
    config = _config(mamba_n_groups=2)
    block = _bamba_block(config)
    norm = _GateAfterNorm(block.norm.weight.numel(), eps=block.norm.variance_epsilon)
    norm.weight = block.norm.weight
    block.norm = norm  # gated after a norm over all channels: one norm group does not replay it
    plan = analyze_mamba2(_layer(block), "mamba", config)
    assert isinstance(plan, NoMatch) and "replaying vLLM's Mamba-2 mixer differs" in plan.reason
    assert "gated norm" not in plan.reason


class _GroupedNorm(BambaRMSNormGated):
    """The gated norm taken over each group's channels, as vLLM's is."""

    groups = 2

    def forward(self, hidden_states, gate=None):
        x = hidden_states * nn.functional.silu(gate)
        grouped = x.view(*x.shape[:-1], self.groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * grouped.view_as(x)


def test_a_norm_over_each_groups_channels_is_proven_with_two_groups_and_not_fixed():
    config = _config(mamba_n_groups=2)
    block = _bamba_block(config)
    block.norm = _grouped(block.norm)
    plan = analyze_mamba2(_layer(block), "mamba", config)
    assert isinstance(plan, Mamba2Plan) and not plan.norm_spans_groups, plan
    assert [condition for condition, _ in plan.fixed] == [
        'tuple(config.time_step_limit) == (0.0, float("inf"))',
        'config.hidden_act in ("silu", "swish")',
    ]


def _grouped(norm: BambaRMSNormGated) -> _GroupedNorm:
    grouped = _GroupedNorm(norm.weight.numel(), eps=norm.variance_epsilon)
    grouped.weight = norm.weight
    return grouped


class _GateAfterNorm(BambaRMSNormGated):
    """The gate applied after the norm (Falcon-H1's ``mamba_norm_before_gate``): not vLLM's order."""

    def forward(self, hidden_states, gate=None):
        return super().forward(hidden_states) * nn.functional.silu(gate)


def test_a_gate_after_the_norm_is_refused_by_the_replay():
    block = _bamba_block()
    norm = _GateAfterNorm(block.norm.weight.numel(), eps=block.norm.variance_epsilon)
    norm.weight = block.norm.weight
    block.norm = norm
    plan = analyze_mamba2(_layer(block), "mamba", _config())
    assert isinstance(plan, NoMatch) and "differs" in plan.reason


def test_clamped_time_steps_are_refused():
    config = _config(time_step_limit=(0.0, 1.0))
    plan = analyze_mamba2(_layer(_bamba_block(config)), "mamba", config)
    assert isinstance(plan, NoMatch) and "does not clamp time steps" in plan.reason


def test_a_block_without_its_skip_parameter_is_not_mamba2():
    block = _bamba_block()
    del block.D
    assert analyze_mamba2(_layer(block), "mamba", _config()) == NoMatch("mamba2", "BambaMixer", NOT_A_MAMBA2)
    # nor of any other kind: the mixer table has nothing more specific to say
    assert analyze_mixer(_layer(block), "mamba", _config()) is None


def test_init_expressions_substitute_earlier_attributes_in_source_order():
    found = {attr: code for attr, code, _ in init_expressions(BambaMixer, _config())}
    assert found["intermediate_size"] == "int(config.mamba_expand * config.hidden_size)"
    assert found["conv_dim"] == (
        "int(config.mamba_expand * config.hidden_size) + 2 * config.mamba_n_groups * config.mamba_d_state"
    )
    assert "layer_idx" not in found  # reads the layer's index, not the config


def test_init_expressions_take_an_eps_or_a_name_the_source_writes_but_never_a_size():
    from transformers.models.zamba2.modeling_zamba2 import Zamba2MambaMixer

    found = {attr: code for attr, code, _ in init_expressions(Zamba2MambaMixer, transformers.Zamba2Config())}
    assert found["norm(eps=)"] == "1e-05"  # `Zamba2RMSNormGated(..., eps=1e-5)`: every config's
    assert found["activation"] == "'silu'"
    assert found["num_heads"] == "config.n_mamba_heads"
    # an int written in the source is no size of the config's
    assert all(
        type(value) is not int or "config" in code
        for _, code, value in init_expressions(Zamba2MambaMixer, transformers.Zamba2Config())
    )


def test_a_layers_child_with_a_mixers_parts_that_fails_its_proof_gives_the_reason():
    """A carried layer without attention: the child that is a Mamba-2 block but fails its
    proof refuses with that reason, not a generic one."""
    from hfrewrite.analyze.mixers import mixer_child
    from hfrewrite.analyze.plan import Refusal

    config = _config(time_step_limit=(0.0, 1.0))
    layer = _layer(_bamba_block(config))
    layer.norm = nn.LayerNorm(64)
    with pytest.raises(Refusal, match="does not clamp time steps"):
        mixer_child(layer, config)
    assert mixer_child(_layer(_bamba_block()), _config()) == "mamba"


def _falcon_block(buffer=None, **changes) -> tuple[nn.Module, transformers.FalconH1Config]:
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer, compute_mup_vector

    config = transformers.FalconH1Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_ssm=128,
        mamba_d_state=8,
        mamba_chunk_size=3,
        **changes,
    )
    torch.manual_seed(0)
    block = FalconH1Mixer(config, layer_idx=0)
    # the base model registers it on each block (Falcon-H1's muP factors per column)
    block.register_buffer(
        "mup_vector", compute_mup_vector(config) if buffer is None else buffer, persistent=False
    )
    with torch.no_grad():
        for param in (block.A_log, block.D, block.dt_bias):
            param.normal_(1.0, 0.3)
    return block, config


def test_falcon_h1s_multipliers_are_proven_factors_at_one_and_otherwise():
    """Its input times ssm_in_multiplier and its projection times the muP vector: proven
    with the default config's 1s (each changed in turn, the block still replays) and with
    a released checkpoint's own values; no gated norm (vLLM's use_rms_norm=False)."""
    for changes in ({}, {"ssm_in_multiplier": 1.25, "ssm_multipliers": [0.3, 0.6, 0.7, 1.2, 0.9]}):
        block, config = _falcon_block(**changes)
        plan = analyze_mamba2(_layer(block), "mamba", config)
        assert isinstance(plan, Mamba2Plan), plan
        assert (plan.input_scale, plan.projection_scale, plan.projection_buffer) == (
            "config.ssm_in_multiplier",
            "compute_mup_vector(config)",
            "mup_vector",
        )
        assert dict(plan.args)["use_rms_norm"] == "False" and "rms_norm_eps" not in dict(plan.args)
        assert ("not (config.mamba_rms_norm)", "proven without the block's gated norm") in plan.fixed


def test_a_factor_no_source_statement_builds_is_refused():
    block, config = _falcon_block(buffer=torch.full((1, 1, 128 * 2 + 16 + 4), 0.5))
    plan = analyze_mamba2(_layer(block), "mamba", config)
    assert isinstance(plan, NoMatch)
    assert plan.reason == "compute_mup_vector(config) does not give the traced self.mup_vector"


def test_a_number_the_forward_reads_otherwise_is_refused(mutate):
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer

    mutate(
        FalconH1Mixer,
        "forward",
        (
            "contextualized_states = self.out_proj(scan_output.to(dtype))",
            "contextualized_states = self.out_proj(scan_output.to(dtype)) * self.ssm_in_multiplier",
        ),
    )
    block, config = _falcon_block()
    plan = analyze_mamba2(_layer(block), "mamba", config)
    assert isinstance(plan, NoMatch)
    assert "self.ssm_in_multiplier" in plan.reason


def test_falcon_h1s_gated_norm_is_proven_with_its_switches_as_traced():
    block, config = _falcon_block(mamba_rms_norm=True, mamba_norm_before_gate=False)
    plan = analyze_mamba2(_layer(block), "mamba", config)
    assert isinstance(plan, Mamba2Plan), plan
    assert [c for c, _ in plan.fixed][-2:] == [
        "config.mamba_rms_norm",
        "(config.mamba_norm_before_gate) is False",
    ]
    # normalised before the gate, it is not vLLM's (which gates, then normalises)
    block, config = _falcon_block(mamba_rms_norm=True, mamba_norm_before_gate=True)
    plan = analyze_mamba2(_layer(block), "mamba", config)
    assert isinstance(plan, NoMatch) and plan.reason.startswith("replaying vLLM's Mamba-2 mixer differs")
