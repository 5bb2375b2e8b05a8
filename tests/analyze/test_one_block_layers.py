"""analyze/block_kinds.py: layers of one block each, the block's kind per layer, read from
what each traced block computes and, where the layer reads its class from a table, from the
table's entry for the layer's key."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hfrewrite.analyze.block_kinds import block_kinds
from hfrewrite.analyze.mixer_plans import ShortConvPlan
from hfrewrite.analyze.mixers import _never_choosing
from hfrewrite.analyze.model import analyze
from hfrewrite.analyze.plan import Mamba2Plan, Refusal
from hfrewrite.errors import HfrewriteError
from hfrewrite.resolve import resolve

CONFIGS = Path(__file__).resolve().parents[2] / "golden" / "configs"


class _Attention(nn.Linear):
    pass


class _Mlp(nn.Linear):
    pass


TABLE = {"attention": _Attention, "mlp": _Mlp}


class _Layer(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.block = TABLE[self.kind](4, 4)


def test_the_table_and_the_traced_kinds_in_its_order():
    kinds = block_kinds([_Layer("mlp"), _Layer("attention"), _Layer("mlp")], "block", "_Attention")
    assert (kinds.table, kinds.key) == ("TABLE", "self.kind")
    assert kinds.kinds == (("attention", "_Attention"), ("mlp", "_Mlp"))


def test_a_layer_whose_block_is_not_its_keys_class_is_refused():
    layer = _Layer("mlp")
    layer.kind = "attention"  # the key now names another class than the block's
    with pytest.raises(Refusal, match=r"`TABLE\[self.kind\]` is not the class"):
        block_kinds([layer], "block", "_Attention")


def test_a_table_of_other_things_is_refused(monkeypatch):
    monkeypatch.setitem(
        sys.modules[__name__].__dict__, "TABLE", {"attention": _Attention, "mlp": "not a class"}
    )
    with pytest.raises(Refusal, match="not a table of classes"):
        block_kinds([_Layer("attention")], "block", "_Attention")


def test_a_block_built_by_name_has_no_table():
    class Direct(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = _Mlp(4, 4)

    kinds = block_kinds([Direct()], "block", "")
    assert (kinds.table, kinds.kinds) == ("", ())


def test_nemotron_hs_layers_are_its_three_kinds():
    torch.manual_seed(0)
    plan = analyze(resolve(str(CONFIGS / "nemotron_h")).config)
    kinds = plan.decoder_layer.block_kinds
    assert (kinds.attr, kinds.table, kinds.key, kinds.attention_class) == (
        "mixer",
        "MIXER_TYPES",
        "self.block_type",
        "NemotronHAttention",
    )
    assert dict(kinds.kinds) == {
        "linear_attention": "NemotronHMamba2Mixer",
        "full_attention": "NemotronHAttention",
        "mlp": "NemotronHMLP",
    }
    assert isinstance(plan.mixer, Mamba2Plan) and plan.mixer.time_step_floor == "config.time_step_min"
    assert plan.mlp.module_class == "NemotronHMLP" and plan.decoder_layer.fused


def test_nemotron_hs_ungated_experts_are_refused_with_why():
    with pytest.raises(HfrewriteError, match="ungated.*CUDA, XPU and ROCm only.*cannot be kept"):
        analyze(resolve("nemotron_h").config)


def test_mamba2_is_attention_free_with_its_norm_over_all_groups():
    """transformers' default Mamba-2: eight groups, every layer one Mamba-2 block."""
    plan = analyze(resolve("mamba2").config)
    assert plan.attention is None and plan.decoder_layer.one_block
    assert isinstance(plan.mixer, Mamba2Plan) and plan.mixer.norm_spans_groups
    assert plan.decoder_layer.block_kinds.attention_class == ""


def test_a_layer_choosing_its_mixer_by_a_config_switch_with_no_attention_traced():
    """Bamba's default config has Mamba-2 layers only; its layer's forward chooses the mixer
    per layer by a config switch that holds on every traced layer: attention-free, the switch
    refused otherwise by the file (config_guards)."""
    plan = analyze(resolve("bamba").config)
    assert plan.attention is None and isinstance(plan.mixer, Mamba2Plan)
    assert ("BambaDecoderLayer", "layer_type == 'linear_attention'", True) in plan.forward_switches


class _Counted(nn.Module):
    """A layer choosing its mixer by a count it keeps, not by its config."""

    def __init__(self):
        super().__init__()
        self.calls = len([1, 2])
        self.mamba = nn.Identity()

    def forward(self, x):
        if self.calls > 1:
            return self.mamba(x)
        return -x


def test_a_layer_choosing_its_mixer_by_anything_else_is_refused():
    plan = ShortConvPlan("Conv", "mamba", 4, False)
    with pytest.raises(Refusal, match="`self.calls > 1` chooses self.mamba per layer, a test on more"):
        _never_choosing(plan, [_Counted(), _Counted()])
