"""analyze/short_conv.py: a block is vLLM's ShortConv only when its formula replays it."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

from hfrewrite.analyze.mixers import with_layer_test
from hfrewrite.analyze.plan import NoMatch, Refusal, ShortConvPlan
from hfrewrite.analyze.short_conv import analyze_short_conv

CONFIG = transformers.Lfm2Config(hidden_size=32, conv_L_cache=3, conv_bias=False)


def _layer(block: nn.Module) -> nn.Module:
    layer = nn.Module()
    layer.conv = block
    return layer


def _lfm2_block() -> nn.Module:
    torch.manual_seed(0)
    return Lfm2ShortConv(CONFIG, layer_idx=0)


def test_lfm2s_short_convolution_is_vllms():
    plan = analyze_short_conv(_layer(_lfm2_block()), "conv", CONFIG)
    assert plan == ShortConvPlan(module_class="Lfm2ShortConv", attr="conv", kernel=3, bias=False)


class _SwappedGates(Lfm2ShortConv):
    """The gates taken in another order (C gates the input, B the output): not vLLM's formula."""

    def forward(self, hidden_states, past_key_values=None, attention_mask=None):
        c, b, x = self.in_proj(hidden_states).transpose(-1, -2).chunk(3, dim=-2)
        mixed = self.conv(b * x)[..., : hidden_states.shape[1]]
        return self.out_proj((c * mixed).transpose(-1, -2))


def test_a_block_the_formula_does_not_replay_is_refused():
    torch.manual_seed(0)
    found = analyze_short_conv(_layer(_SwappedGates(CONFIG, layer_idx=0)), "conv", CONFIG)
    assert isinstance(found, NoMatch) and "replaying vLLM's gated short convolution differs" in found.reason


def test_parts_named_otherwise_would_not_load_and_are_refused():
    block = _lfm2_block()
    block.proj_in = block.in_proj
    del block.in_proj
    found = analyze_short_conv(_layer(block), "conv", CONFIG)
    assert isinstance(found, NoMatch) and "not vLLM's ShortConv's in_proj, conv, out_proj" in found.reason


def test_a_kernel_the_config_does_not_give_shortconv_is_refused():
    other = transformers.Lfm2Config(hidden_size=32, conv_L_cache=4, conv_bias=False)
    found = analyze_short_conv(_layer(_lfm2_block()), "conv", other)
    assert isinstance(found, NoMatch) and "config.conv_L_cache (4), not 3" in found.reason


def test_attention_is_not_a_short_convolution():
    layer = nn.Module()
    layer.self_attn = nn.Linear(4, 4)
    found = analyze_short_conv(layer, "self_attn", CONFIG)
    assert isinstance(found, NoMatch) and found.reason == "not one Conv1d and two Linears"


class _Layer(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.is_attention_layer = kind == "full_attention"
        self.self_attn, self.conv = nn.Identity(), nn.Identity()

    def forward(self, x):
        if self.is_attention_layer:
            return self.self_attn(x)
        return self.conv(x)  # (no else: the test chooses nothing, see below)


class _ChoosingLayer(_Layer):
    def forward(self, x):
        if self.is_attention_layer:
            x = self.self_attn(x)
        else:
            x = self.conv(x)
        return x


PLAN = ShortConvPlan(module_class="Lfm2ShortConv", attr="conv", kernel=3, bias=False)


def test_the_layers_own_test_is_proven_on_every_layer():
    layers = [_ChoosingLayer("conv"), _ChoosingLayer("full_attention")]
    plan = with_layer_test(PLAN, layers, [False, True], "self_attn")
    assert (plan.layer_test, plan.attention_when) == ("self.is_attention_layer", True)


def test_a_test_that_does_not_tell_the_layers_apart_is_refused():
    layers = [_ChoosingLayer("conv"), _ChoosingLayer("full_attention")]
    with pytest.raises(Refusal, match="does not tell its attention layers apart"):
        with_layer_test(PLAN, layers, [True, False], "self_attn")


def test_no_if_choosing_the_mixer_is_refused():
    layers = [_Layer("conv"), _Layer("full_attention")]
    with pytest.raises(Refusal, match="no one test of its forward chooses self_attn or conv"):
        with_layer_test(PLAN, layers, [False, True], "self_attn")
