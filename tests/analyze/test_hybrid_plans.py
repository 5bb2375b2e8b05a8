"""The plans of the hybrid goldens' configs: what the analysis proves for LFM2 and LFM2-MoE."""

from __future__ import annotations

from pathlib import Path

import pytest

from hfrewrite.analyze.model import analyze
from hfrewrite.analyze.rope_styles import RopeLayers
from hfrewrite.analyze.router_scorings import Scoring
from hfrewrite.resolve import resolve

CONFIGS = Path(__file__).resolve().parents[2] / "golden" / "configs"


@pytest.fixture(scope="module")
def lfm2_moe():
    return analyze(resolve(str(CONFIGS / "lfm2_moe")).config)


def test_lfm2s_conv_layers_are_shortconv_chosen_by_the_layers_test():
    plan = analyze(resolve(str(CONFIGS / "lfm2")).config)
    conv = plan.mixer
    assert (conv.module_class, conv.attr, conv.kernel, conv.bias) == ("Lfm2ShortConv", "conv", 3, False)
    assert (conv.layer_test, conv.attention_when) == ("self.is_attention_layer", True)
    assert plan.attention.module_class == "Lfm2Attention"  # the first attention layer leads


def test_lfm2_moe_traces_a_dense_and_a_sparse_layer(lfm2_moe):
    assert lfm2_moe.mixer is not None and lfm2_moe.mlp is not None and lfm2_moe.moe is not None


def test_lfm2_moe_routing_and_activation_are_proven(lfm2_moe):
    moe = lfm2_moe.moe
    assert (moe.scoring, moe.correction_bias, moe.activation) == (Scoring.SIGMOID, "expert_bias", "silu")
    assert ("config.use_expert_bias", True) in moe.init_switches


def test_bambas_mamba2_layers_are_mambamixer2_chosen_by_the_layers_test():
    plan = analyze(resolve(str(CONFIGS / "bamba")).config)
    mamba = plan.mixer
    assert (type(mamba).__name__, mamba.module_class, mamba.attr) == ("Mamba2Plan", "BambaMixer", "mamba")
    assert (mamba.layer_test, mamba.attention_when) == ("self.block_type == 'linear_attention'", False)
    assert (
        mamba.arg("num_heads") == "config.mamba_n_heads"
        and mamba.arg("ssm_state_size") == "config.mamba_d_state"
    )
    assert plan.decoder_layer.fused  # its layer returns (hidden states, weights or None): fused all the same


def test_granite_4_h_layers_are_carried_with_a_shared_mlp_beside_the_moe():
    plan = analyze(resolve(str(CONFIGS / "granitemoehybrid")).config)
    layer = plan.decoder_layer
    assert not layer.fused and (layer.mlp_block, layer.shared_mlp_block) == ("block_sparse_moe", "shared_mlp")
    assert (plan.mixer.layer_test, plan.mixer.attention_when) == ("self.mamba is not None", False)
    assert plan.mlp.module_class == "GraniteMoeHybridMLP" and plan.moe is not None
    assert plan.attention.rope_layers is RopeLayers.NONE  # no rope: the Mamba-2 layers see the order
    assert ("config.position_embedding_type == 'rope'", False) in plan.base_init_switches


def test_falcon_h1s_mamba2_sits_beside_the_attention_in_every_layer():
    """Falcon-H1: one layer class holding attention, a Mamba-2 block and an MLP; the layer is
    carried (attention and mixer on one norm's output, their outputs scaled and summed), no
    test chooses between them, and the mixer's muP factors are proven."""
    from transformers import AutoConfig

    plan = analyze(AutoConfig.for_model("falcon_h1"))
    layer, mixer = plan.decoder_layer, plan.mixer
    assert (layer.attention_block, layer.mixer_block, layer.mlp_block, layer.fused) == (
        "self_attn",
        "mamba",
        "feed_forward",
        False,
    )
    assert (mixer.module_class, mixer.layer_test, mixer.input_scale) == (
        "FalconH1Mixer",
        "",
        "config.ssm_in_multiplier",
    )
    assert plan.attention.path_scales == (("k", "self.key_multiplier"),)
    # `up(x) * act(gate(x) * m)`, then `down(y) * m'`: the act kept per gate/up lane, the
    # output's factor on the forward's own line
    assert (plan.mlp.module_class, plan.mlp.form.name) == ("FalconH1MLP", "PAIRWISE")
