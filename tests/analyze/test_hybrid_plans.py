"""The plans of the hybrid goldens' configs: what the analysis proves for LFM2 and LFM2-MoE."""

from __future__ import annotations

from pathlib import Path

import pytest

from hfrewrite.analyze.model import analyze
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
    assert (moe.scoring, moe.correction_bias, moe.activation) == ("sigmoid", "expert_bias", "silu")
    assert ("config.use_expert_bias", True) in moe.init_switches
