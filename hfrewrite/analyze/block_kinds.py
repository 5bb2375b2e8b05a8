"""Layers of one block each, the block's kind chosen per layer (NemotronH's ``NemotronHBlock``:
``residual + mixer(norm(h))``, its ``mixer`` an attention, a Mamba-2 block, an MLP or a MoE
by ``config.layers_block_type[layer_idx]``).

Each traced layer's one block is analysed as what it computes: an attention (its call through
transformers' interface), a mixer proven one of vLLM's layers (mixers.py), or a dense MLP; a
block that is none of these refuses with the reason of the kind it has the parts of. vLLM's
fused norm takes the layer's one norm, and the file's forward calls the block as its kind
takes it: ``isinstance(self.<block>, <attention class>)`` (a fact of the trace, not a name)
chooses the attention's call.

Where ``__init__`` builds the block from a table of the modeling module
(``self.mixer = MIXER_TYPES[self.block_type](config, layer_idx=layer_idx)``), the table is a
module-level dict of strings to classes, and the key read on every traced layer gives that
layer's block class, the file builds the block under one test per traced key (emitted by
passes/block_kinds.py), so that each class's constructor is rewritten like any other; a key
no traced layer had refuses when vLLM builds the layer.
"""

from __future__ import annotations

import ast
import dataclasses
import sys

from torch import nn

from hfrewrite.analyze.attention import analyze_attention
from hfrewrite.analyze.branches import method_tree
from hfrewrite.analyze.carried_mlp import carry_mlp
from hfrewrite.analyze.layer_agreement import LayerFacts, attention_free, attention_layers
from hfrewrite.analyze.leaf_modules import is_experts
from hfrewrite.analyze.mixers import analyze_mixer
from hfrewrite.analyze.mla import analyze_mla, is_mla
from hfrewrite.analyze.mlp import analyze_mlp
from hfrewrite.analyze.moe import analyze_moe
from hfrewrite.analyze.plan import BlockKinds, DecoderLayerPlan, NoMatch, Refusal
from hfrewrite.analyze.trace import Traced, is_attention_leaf

PATTERN = "block_kinds"


def one_block_facts(
    traced: Traced, decoder: DecoderLayerPlan | NoMatch, config, small, layer_type: str | None, layer_idx: int
) -> LayerFacts | None:
    """The facts of a traced layer of one block (``decoder.blocks``), by what its block
    computes; the decoder plan names it as every kind's (the layers agree on it). None where
    the layer is not one block, or its block is of no kind (the carried layer's analysis says
    why)."""
    if isinstance(decoder, NoMatch) or len(decoder.blocks) != 1:
        return None
    block = decoder.blocks[0].block
    decoder = dataclasses.replace(decoder, attention_block=block, mlp_block=block)
    if any(is_attention_leaf(n) for n in traced.nodes_in(block)):
        attention = block_attention(traced, block, small, layer_type, layer_idx)
        if isinstance(attention, NoMatch):
            raise Refusal(attention)
        return LayerFacts(decoder, attention, None, None, None)
    mixer = analyze_mixer(traced.module, block, small, layer_idx)
    if isinstance(mixer, NoMatch):
        raise Refusal(mixer)
    if mixer is not None:
        return LayerFacts(decoder, None, None, None, None, mixer)
    mlp = analyze_mlp(traced, block, config)
    if not isinstance(mlp, NoMatch):
        return LayerFacts(decoder, None, mlp, None, None)
    experts = [
        traced.submodule(n)
        for n in traced.nodes_in(block)
        if n.op == "call_module" and is_experts(traced.submodule(n))
    ]
    if not experts:
        return None
    moe = analyze_moe(traced, block, getattr(config, "hidden_act", None) or "", config)
    why = moe.reason if isinstance(moe, NoMatch) else "a fused MoE as a layer of its own is not proven"
    if _ungated(experts[0]):
        why += (
            " (its experts are ungated, one projection in and one out: vLLM 0.32 runs such experts "
            "(is_act_and_mul=False) on CUDA, XPU and ROCm only, not on the CPU build the proofs run on)"
        )
    cls = type(traced.module.get_submodule(block)).__name__
    declined = NoMatch(PATTERN, cls, f"a mixture of experts as layer {layer_idx}'s one block: {why}")
    carry_mlp(traced, block, declined, config)  # refuses, saying why the source's block cannot be kept
    raise Refusal(
        NoMatch(PATTERN, cls, f"{declined.reason}; its source kept as a layer's one block: not proven")
    )


def block_attention(traced: Traced, block: str, small, layer_type: str | None, layer_idx: int):
    """The plan of the attention ``block`` (MLA's where its latent shows), or why not."""
    if is_mla(traced, block):
        return analyze_mla(traced, block, small, layer_type)
    return analyze_attention(traced, block, small, layer_type, layer_idx)


def _ungated(experts: nn.Module) -> bool:
    """The experts hold two stacked weights and no more, [E, I, H] and [E, H, I]: a projection
    in and one out per expert, no gate beside the first (NemotronH's)."""
    weights = [p for p in experts.parameters() if p.dim() == 3]
    if len(weights) != 2 or len(list(experts.parameters())) != 2:
        return False
    (e, i, h), (e2, h2, i2) = weights[0].shape, weights[1].shape
    return e == e2 and (i, h) == (i2, h2)


def block_kinds(layers: list[nn.Module], attr: str, attention_class: str) -> BlockKinds:
    """The facts of the traced ``layers``' one block ``attr``: its class per layer, and the
    table its ``__init__`` reads that class from (if it does)."""
    cls = type(layers[0])
    built = _table_built(cls, attr)
    if built is None:
        return BlockKinds(attr, attention_class)
    table_name, key = built
    table = getattr(sys.modules[cls.__module__], table_name, None)
    if not (
        isinstance(table, dict) and all(isinstance(k, str) and isinstance(v, type) for k, v in table.items())
    ):
        raise Refusal(NoMatch(PATTERN, cls.__name__, f"{table_name} is not a table of classes by name"))
    traced: dict[str, str] = {}
    code = compile(ast.parse(key, mode="eval"), "<key>", "eval")
    for layer in layers:
        try:
            value = eval(code, {}, {"self": layer})  # the source's own expression
        except Exception as exc:
            raise Refusal(NoMatch(PATTERN, cls.__name__, f"`{key}` does not evaluate on a layer")) from exc
        block = layer.get_submodule(attr)
        if table.get(value) is not type(block):
            why = f"`{table_name}[{key}]` is not the class of layer's {attr} ({type(block).__name__})"
            raise Refusal(NoMatch(PATTERN, cls.__name__, why))
        traced[value] = type(block).__name__
    kinds = tuple((k, traced[k]) for k in table if k in traced)
    return BlockKinds(attr, attention_class, table_name, key, kinds)


def _table_built(cls: type, attr: str) -> tuple[str, str] | None:
    """(table, key) for ``self.<attr> = <table>[<key>](...)`` in ``cls.__init__``, the key
    an expression of ``self`` alone."""
    tree = method_tree(cls, "__init__")
    for node in ast.walk(tree) if tree is not None else ():
        if not (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Attribute)
            and isinstance(node.targets[0].value, ast.Name)
            and node.targets[0].value.id == "self"
            and node.targets[0].attr == attr
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Subscript)
            and isinstance(node.value.func.value, ast.Name)
        ):
            continue
        key = node.value.func.slice
        if {n.id for n in ast.walk(key) if isinstance(n, ast.Name)} == {"self"}:
            return node.value.func.value.id, ast.unparse(key)
    return None


def with_kinds(decoder: DecoderLayerPlan, layers: list[nn.Module], attention_class: str) -> DecoderLayerPlan:
    """``decoder`` of one-block ``layers`` marked as choosing its block's kind."""
    kinds = block_kinds(layers, decoder.blocks[0].block, attention_class)
    return dataclasses.replace(decoder, block_kinds=kinds)


def lead_layer(per_layer: list, layers: list[nn.Module]) -> tuple[bool, int, DecoderLayerPlan]:
    """Whether no layer attends (Mamba-2 alone: the layers agree on no attention); the layer
    that leads (a hybrid's first attention layer: the other mixer's layers agree with it); its
    decoder plan, with the kinds of a one-block layer's block."""
    free = attention_free(per_layer)
    lead = 0 if free else per_layer.index(attention_layers(per_layer)[0])
    decoder = per_layer[lead].decoder
    if decoder.one_block:  # one block each, of a kind per layer
        attending = per_layer[lead].attention
        decoder = with_kinds(decoder, layers, attending.module_class if attending else "")
    return free, lead, decoder
