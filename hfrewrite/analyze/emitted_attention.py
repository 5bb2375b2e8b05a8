"""The attention facts a file is emitted from: the lead layer's plan (layer_agreement.py's
``rope_layers``), with the config fields or the source's own expressions of its head counts,
its rotary width, and the source lines it was traced from. Layers whose head counts differ
(OpenELM's layer-wise scaling) are sized by expressions that give each traced layer its own."""

from __future__ import annotations

import dataclasses

from hfrewrite.analyze.head_counts import evaluate_count, head_expressions, head_fields
from hfrewrite.analyze.layer_agreement import LayerFacts, attention_layers, rope_layers
from hfrewrite.analyze.plan import AttentionPlan, MlaPlan, refuse
from hfrewrite.analyze.rope import rotary_field
from hfrewrite.analyze.trace import Traced
from hfrewrite.analyze.traced_lines import traced_lines


def emitted_attention(
    per_layer: list[LayerFacts], traces: list[Traced], at: int, small
) -> AttentionPlan | MlaPlan:
    """The attention facts to emit (:func:`rope_layers`), with the config fields of the head
    counts and rotary width and the source lines the attention was traced from (``at``: the
    lead layer's index)."""
    attention = rope_layers(per_layer)
    lead, traced = per_layer[at], traces[at]
    if isinstance(attention, AttentionPlan):
        lines = traced_lines(traced, lead.decoder.attention_block)
        attention = dataclasses.replace(
            attention, **head_fields(small, attention), **rotary_field(small, attention), traced_lines=lines
        )
        block = lead.decoder.attention_block
        modules = [
            t.module.get_submodule(block) for t, f in zip(traces, per_layer) if f.attention is not None
        ]
        counts = [(f.attention.num_heads, f.attention.num_kv_heads) for f in attention_layers(per_layer)]
        others = tuple((m, h, kv) for m, (h, kv) in zip(modules, counts))
        attention = head_expressions(attention, traced.module.get_submodule(block), small, others)
        per_layer_heads(per_layer, attention, modules, small)
    return attention


def per_layer_heads(per_layer: list[LayerFacts], attention: AttentionPlan, modules: list, small) -> None:
    """Layers whose head counts differ are sized by the source's expressions, evaluated per
    layer (``modules``: each attention layer's block) to that layer's counts; a config field
    would give them all one count, and refuses."""
    layers = attention_layers(per_layer)
    counts = [(f.attention.num_heads, f.attention.num_kv_heads) for f in layers]
    if len(set(counts)) == 1:
        return
    exprs = (attention.heads_expr, attention.kv_heads_expr)
    per_layer_exprs = not (attention.heads_field or attention.kv_heads_field) and all(exprs)
    if per_layer_exprs and all(
        tuple(evaluate_count(text, small, module) for text in exprs) == count
        for module, count in zip(modules, counts)
    ):
        return
    reason = f"layers differ in their head counts {sorted(set(counts))}, and no expression of the source gives each its own"
    refuse("uniform_layers", reason, attention.module_class)
