"""analyze/mamba1.py: a block is vLLM's MambaMixer only when its formula replays it, built
from the config expressions the block's own __init__ sizes it with."""

from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaMixer
from transformers.models.jamba.modeling_jamba import JambaMambaMixer
from transformers.models.mamba.modeling_mamba import MambaMixer

from hfrewrite.analyze.mamba1 import NOT_A_MAMBA1, analyze_mamba1
from hfrewrite.analyze.mixers import analyze_mixer
from hfrewrite.analyze.plan import Mamba1Plan, NoMatch

SIZES = {"hidden_size": 32, "state_size": 8, "intermediate_size": 64, "num_hidden_layers": 2}


def _layer(block: nn.Module) -> nn.Module:
    layer = nn.Module()
    layer.mixer = block
    return layer


def _widened(block: nn.Module) -> nn.Module:
    """The block with random weights past the init's, so that a mixed-up part shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in block.named_parameters():
            param.normal_(1.0 if param.ndim == 1 else 0.0, 0.3)
    return block


def _mamba(config=None, cls=MambaMixer) -> tuple[nn.Module, object]:
    config = config or transformers.MambaConfig(**SIZES)
    return _widened(cls(config, layer_idx=0, initialize_mixer_weights=False)), config


def test_mambas_mixer_is_vllms_with_its_configs_expressions():
    block, config = _mamba()
    plan = analyze_mamba1(_layer(block), "mixer", config)
    assert isinstance(plan, Mamba1Plan), plan
    assert dict(plan.args) == {
        "hidden_size": "config.hidden_size",
        "ssm_state_size": "config.state_size",
        "conv_kernel_size": "config.conv_kernel",
        "intermediate_size": "config.intermediate_size",
        "time_step_rank": "int(config.time_step_rank)",
        "use_conv_bias": "config.use_conv_bias",
        "use_bias": "config.use_bias",
        "activation": "config.hidden_act",
        "use_rms_norm": "False",
    }
    assert [condition for condition, _ in plan.fixed] == ['config.hidden_act in ("silu", "swish")']
    assert plan.checkpoint_suffix_renames == ((".mixer.A_log", ".mixer.A"),)
    # the row of the mixers a hybrid layer may hold finds it too
    assert analyze_mixer(_layer(block), "mixer", config) == plan


def test_falcon_mambas_weightless_norms_are_vllms_without_weights():
    config = transformers.FalconMambaConfig(**SIZES, mixer_rms_eps=1e-3)
    plan = analyze_mamba1(_layer(_mamba(config, FalconMambaMixer)[0]), "mixer", config)
    assert isinstance(plan, Mamba1Plan), plan
    args = dict(plan.args)
    assert (args["use_rms_norm"], args["rms_norm_has_weight"], args["rms_norm_eps"]) == (
        "True",
        "False",
        "config.mixer_rms_eps",
    )


def test_jambas_weighted_norms_are_vllms_with_weights():
    config = transformers.JambaConfig(
        hidden_size=32, mamba_d_state=8, mamba_expand=2, num_hidden_layers=2, use_mamba_kernels=False
    )
    plan = analyze_mamba1(_layer(_widened(JambaMambaMixer(config, layer_idx=0))), "mixer", config)
    assert isinstance(plan, Mamba1Plan), plan
    args = dict(plan.args)
    assert (args["use_rms_norm"], args["rms_norm_has_weight"], args["rms_norm_eps"]) == (
        "True",
        "True",
        "config.rms_norm_eps",
    )


class _NoSkip(MambaMixer):
    """A Mamba-1 block whose output drops the D skip: the same parts, another function."""

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        with torch.no_grad():
            saved = self.D.clone()
            self.D.zero_()
            try:
                return super().forward(hidden_states)
            finally:
                self.D.copy_(saved)


def test_a_block_computing_something_else_is_not_replaced():
    block, config = _mamba(cls=_NoSkip)
    plan = analyze_mamba1(_layer(block), "mixer", config)
    assert isinstance(plan, NoMatch) and plan.reason.startswith(
        "replaying vLLM's Mamba-1 mixer differs by"
    ), plan


def test_a_time_step_projection_without_bias_is_not_vllms():
    block, config = _mamba()
    block.dt_proj = nn.Linear(block.dt_proj.in_features, block.dt_proj.out_features, bias=False)
    assert analyze_mamba1(_layer(block), "mixer", config) == NoMatch(
        "mamba1", "MambaMixer", "dt_proj has no bias"
    )


def test_an_activation_other_than_silu_is_not_vllms():
    config = transformers.MambaConfig(**SIZES, hidden_act="gelu")
    plan = analyze_mamba1(_layer(_mamba(config)[0]), "mixer", config)
    assert isinstance(plan, NoMatch) and "activation" in plan.reason, plan


def test_other_blocks_are_not_mamba1():
    block = nn.Module()
    block.in_proj, block.out_proj = nn.Linear(4, 8), nn.Linear(8, 4)
    assert analyze_mamba1(_layer(block), "mixer", None) == NoMatch("mamba1", "Module", NOT_A_MAMBA1)
