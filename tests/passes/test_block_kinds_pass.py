"""block_kinds: a one-block layer's block read from a table of classes becomes one
construction per traced kind, so that each class is built by name."""

from __future__ import annotations

import dataclasses

import pytest
from hfrewrite.passes import block_kinds

from hfrewrite.analyze.plan import BlockKinds
from hfrewrite.errors import HfrewriteError
from tests.passes.harness import apply, assert_rewrites
from tests.passes.plans import llama_like

KINDS = BlockKinds(
    attr="mixer",
    attention_class="LlamaAttention",
    table="MIXER_TYPES",
    key="self.block_type",
    kinds=(("mamba", "LlamaMamba"), ("attention", "LlamaAttention")),
)


def _plan(kinds=KINDS):
    plan = llama_like()
    return dataclasses.replace(plan, decoder_layer=dataclasses.replace(plan.decoder_layer, block_kinds=kinds))


BEFORE = """\
MIXER_TYPES = {"mamba": LlamaMamba, "attention": LlamaAttention, "moe": LlamaMoE}


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.block_type = config.layer_types[layer_idx]
        # the block of this layer's kind
        self.mixer = MIXER_TYPES[self.block_type](config, layer_idx=layer_idx)
"""

AFTER = """\


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.block_type = config.layer_types[layer_idx]
        # the block of this layer's kind
        if self.block_type == 'mamba':
            self.mixer = LlamaMamba(config, layer_idx=layer_idx)
        elif self.block_type == 'attention':
            self.mixer = LlamaAttention(config, layer_idx=layer_idx)
        else:
            raise ValueError("hfrewrite: this file needs self.block_type in ('mamba', 'attention'): the kinds of mixer it was proven with")
"""


def test_the_tables_lookup_becomes_one_construction_per_traced_kind():
    assert_rewrites(block_kinds, BEFORE, AFTER, _plan())


def test_a_table_read_elsewhere_stays():
    before = BEFORE + "\n\ndef kinds():\n    return list(MIXER_TYPES)\n"
    out = apply(block_kinds, before, _plan()).module.code
    assert out.startswith("MIXER_TYPES = {") and "elif self.block_type == 'attention':" in out


def test_no_table_no_change():
    plan = _plan(dataclasses.replace(KINDS, table="", key="", kinds=()))
    assert apply(block_kinds, BEFORE, plan).module.code == BEFORE


def test_a_block_built_otherwise_is_refused():
    other = BEFORE.replace("MIXER_TYPES[self.block_type]", "MIXER_TYPES[config.kind]")
    with pytest.raises(HfrewriteError, match="not built once from MIXER_TYPES"):
        apply(block_kinds, other, _plan())
