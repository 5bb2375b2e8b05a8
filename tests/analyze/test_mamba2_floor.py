"""analyze/mamba2_floor.py: a Mamba-2 block's time-step floor is kept only where a replay with
its time steps pushed below it shows the block applying it; a ceiling is refused."""

from __future__ import annotations

import math

import torch
import transformers
from torch import nn
from transformers.models.bamba.modeling_bamba import BambaMixer
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

from hfrewrite.analyze.mamba2 import analyze_mamba2
from hfrewrite.analyze.mamba2_floor import CLAMP, time_step_limits
from hfrewrite.analyze.plan import Mamba2Plan, NoMatch

BAMBA = {"hidden_size": 64, "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 8, "mamba_chunk_size": 3}
NEMOTRON_H = {
    "hidden_size": 64,
    "mamba_num_heads": 4,
    "mamba_head_dim": 32,
    "ssm_state_size": 8,
    "n_groups": 2,
    "chunk_size": 3,
    "layers_block_type": ["linear_attention"],
    "num_hidden_layers": 1,
}


def _layer(block: nn.Module) -> nn.Module:
    layer = nn.Module()
    layer.mixer = block
    with torch.no_grad():  # past the init's ones, so that a mixed-up D or dt_bias shows
        for param in (block.A_log, block.D, block.dt_bias, block.norm.weight):
            param.normal_(1.0, 0.3)
    return layer


def _nemotron_h(**changes):
    torch.manual_seed(0)
    config = transformers.NemotronHConfig(**{**NEMOTRON_H, **changes})
    return _layer(NemotronHMamba2Mixer(config, layer_idx=0)), config


def _bamba(limit: tuple[float, float]):
    torch.manual_seed(0)
    config = transformers.BambaConfig(**BAMBA, time_step_limit=limit)
    return _layer(BambaMixer(config, layer_idx=0)), config


def test_nemotron_hs_floor_is_proven_as_its_config_expression():
    layer, config = _nemotron_h()
    plan = analyze_mamba2(layer, "mixer", config)
    assert isinstance(plan, Mamba2Plan), plan
    assert plan.time_step_floor == "config.time_step_min"
    # its ceiling is the literal inf: no condition on the config for it
    assert not [condition for condition, _ in plan.fixed if "time_step" in condition]


def test_a_floor_held_in_one_config_pair_keeps_its_ceiling_checked():
    layer, config = _bamba((0.3, math.inf))
    plan = analyze_mamba2(layer, "mixer", config)
    assert isinstance(plan, Mamba2Plan), plan
    assert plan.time_step_floor == "config.time_step_limit[0]"
    assert (
        'config.time_step_limit[1] == float("inf")',
        "the file floors time steps, it caps none",
    ) in plan.fixed


def test_no_floor_keeps_the_file_checking_there_is_none():
    layer, config = _bamba((0.0, math.inf))
    plan = analyze_mamba2(layer, "mixer", config)
    assert isinstance(plan, Mamba2Plan) and plan.time_step_floor == ""
    assert ('tuple(config.time_step_limit) == (0.0, float("inf"))', CLAMP) in plan.fixed


def test_a_floor_the_forward_does_not_apply_is_refused_by_the_replay():
    """The config's pair says 0.3, the block's own limits (what its scan reads) say none."""
    layer, config = _bamba((0.3, math.inf))
    layer.mixer.time_step_limit = (0.0, math.inf)
    plan = analyze_mamba2(layer, "mixer", config)
    assert isinstance(plan, NoMatch) and "with the floor differs" in plan.reason, plan


def test_a_floor_the_replay_cannot_see_is_refused():
    """A floor too small to change any replayed output is no proof that the block applies it."""
    layer, config = _nemotron_h(time_step_min=1e-12)
    plan = analyze_mamba2(layer, "mixer", config)
    assert isinstance(plan, NoMatch) and "cannot tell its time-step floor" in plan.reason, plan


def test_ceilings_and_two_floors_are_refused():
    def limits(*pairs):
        return time_step_limits([(f"a{i}", f"config.limit{i}", pair) for i, pair in enumerate(pairs)])

    assert CLAMP in limits((0.0, 1.0))
    assert CLAMP in limits((0.1, 2.0))
    assert CLAMP in limits((0.1, math.inf), (0.2, math.inf))
    kept = limits((0.1, math.inf))
    assert kept.floor == "config.limit0[0]" and kept.floor_value == 0.1
    assert limits((0.0, math.inf)).floor == ""
