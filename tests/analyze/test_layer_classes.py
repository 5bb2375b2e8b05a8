"""analyze/layer_classes.py: decoder layers of two classes, the attention layers' and a
hybrid's other mixer's (Jamba's), each rewritten with its own plan; any other split of
classes refused with the reason."""

from __future__ import annotations

import pytest
import transformers
from torch import nn

from hfrewrite.analyze.layer_agreement import LayerFacts
from hfrewrite.analyze.layer_classes import carried_with_attention, mixer_layer, unrun_classes
from hfrewrite.analyze.mixer_plans import ShortConvPlan
from hfrewrite.analyze.model import analyze
from hfrewrite.analyze.plan import DecoderLayerPlan, NoMatch, Refusal, ResidualBlock
from hfrewrite.errors import HfrewriteError


@pytest.fixture(scope="module")
def jamba():
    return analyze(transformers.AutoConfig.for_model("jamba"))


def test_jambas_mamba_layers_are_a_class_of_their_own_with_their_plan(jamba):
    assert jamba.decoder_layer.module_class == "JambaAttentionDecoderLayer"
    own = jamba.mixer_layer
    assert (own.module_class, own.attention_block, own.mlp_block) == (
        "JambaMambaDecoderLayer",
        "mamba",
        "feed_forward",
    )
    assert own.fused and [b.norm for b in own.blocks] == ["input_layernorm", "pre_ff_layernorm"]
    assert jamba.decoder_layers == (jamba.decoder_layer, own)
    # no test of a layer's forward chooses the mixer: its class does
    assert (type(jamba.mixer).__name__, jamba.mixer.attr, jamba.mixer.layer_test) == (
        "Mamba1Plan",
        "mamba",
        "",
    )


def test_jambas_moe_routes_in_the_block_through_its_own_linear(jamba):
    moe = jamba.moe
    assert (moe.router, moe.router_class, moe.top_k_attr, moe.renormalize) == (
        "router",
        "Linear",
        "top_k",
        False,
    )
    assert jamba.mlp.module_class == "JambaMLP"  # the layers without experts


def _facts(cls: str, attention: bool, mixer: bool, fused: bool = True) -> LayerFacts:
    block = "self_attn" if attention else "mixer"
    blocks = (ResidualBlock("input_layernorm", block), ResidualBlock("post_attention_layernorm", "mlp"))
    decoder = DecoderLayerPlan(cls, blocks if fused else (), attention_block=block)
    conv = ShortConvPlan("Conv", "mixer", 3, False) if mixer else None
    return LayerFacts(decoder, object() if attention else None, None, None, None, conv)


def test_one_class_has_no_mixer_layer():
    per_layer = [_facts("Layer", True, False), _facts("Layer", False, True)]
    assert mixer_layer(per_layer, per_layer[0].decoder) is None


def test_the_mixers_own_class_is_its_plan():
    per_layer = [
        _facts("Mixing", False, True),
        _facts("Attending", True, False),
        _facts("Mixing", False, True),
    ]
    assert mixer_layer(per_layer, per_layer[1].decoder) == per_layer[0].decoder


@pytest.mark.parametrize(
    "per_layer",
    [
        # two attention classes
        [_facts("A", True, False), _facts("B", True, False)],
        # the mixer's layers of two classes
        [_facts("A", True, False), _facts("B", False, True), _facts("C", False, True)],
        # a layer of neither attention nor the mixer
        [_facts("A", True, False), _facts("B", False, True), _facts("C", False, False)],
    ],
)
def test_any_other_split_of_classes_is_refused(per_layer):
    with pytest.raises(Refusal, match="decoder layers of several classes"):
        mixer_layer(per_layer, per_layer[0].decoder)


def test_a_carried_mixer_class_beside_fused_attention_layers_is_refused():
    per_layer = [_facts("A", True, False), _facts("B", False, True, fused=False)]
    with pytest.raises(Refusal, match="attention layers' forward fused and the mixer layers' carried"):
        mixer_layer(per_layer, per_layer[0].decoder)


def test_carried_attention_layers_carry_the_mixer_class_too():
    """OLMo-hybrid's attention layers are post-norm (carried); its gated-delta-net layers,
    pre-norm, are carried too, so that every layer returns its hidden states alone."""
    per_layer = [_facts("A", True, False, fused=False), _facts("B", False, True)]
    own = mixer_layer(per_layer, per_layer[0].decoder)
    assert (own.module_class, own.fused) == ("B", False)
    # --explain says why a forward that would fuse is carried
    (row,) = carried_with_attention(per_layer, own)
    assert (row.pattern, row.module_class) == ("fused_residual_norm", "B")
    assert "carried from the source as the attention layers' class is" in row.reason
    assert carried_with_attention(per_layer, None) == ()


def test_an_example_run_that_fails_says_its_layers_are_of_several_classes():
    class HybridLayer(nn.Module):
        pass

    class MambaLayer(nn.Module):
        pass

    failed = Refusal(NoMatch("example run", "M", "RuntimeError: shape"))
    said = unrun_classes([MambaLayer(), HybridLayer()], failed).no_match.reason
    assert (
        said
        == "RuntimeError: shape (the shrunk model's decoder layers are of several classes: HybridLayer, MambaLayer)"
    )
    assert unrun_classes([MambaLayer(), MambaLayer()], failed) is failed


def test_zamba2_is_refused_on_its_hybrid_layer():
    # its shrunk copy runs (the sizes its config derives follow the shrunk ones): the refusal
    # names the layer that wraps a shared transformer block beside a Mamba layer
    with pytest.raises(
        HfrewriteError,
        match=r"Zamba2HybridLayer: decoder_layer: 2 children beside the attention in shared_transformer \(Zamba2AttentionDecoderLayer\) hold linears",
    ):
        analyze(transformers.AutoConfig.for_model("zamba2"))
