"""The attention facts a file is emitted from: the lead layer's plan (layer_agreement.py's
``rope_layers``), with the config fields or the source's own expressions of its head counts,
its rotary width, and the source lines it was traced from. Layers whose head counts differ
(OpenELM's layer-wise scaling) are sized by expressions that give each traced layer its own."""

from __future__ import annotations

import dataclasses

from hfrewrite.analyze.chunked_layers import chunked_layers
from hfrewrite.analyze.head_counts import head_expressions, head_fields
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
            attention,
            **head_fields(small, attention),
            **rotary_field(small, attention),
            traced_lines=lines,
            attention_chunk=chunked_layers(per_layer, small, attention),
        )
        block = lead.decoder.attention_block
        modules = [
            t.module.get_submodule(block) for t, f in zip(traces, per_layer) if f.attention is not None
        ]
        counts = [(f.attention.num_heads, f.attention.num_kv_heads) for f in attention_layers(per_layer)]
        others = tuple((m, h, kv) for m, (h, kv) in zip(modules, counts))
        attention = head_expressions(attention, traced.module.get_submodule(block), small, others)
        per_layer_heads(per_layer, attention)
    return attention


def per_layer_heads(per_layer: list[LayerFacts], attention: AttentionPlan) -> None:
    """Layers whose head counts differ are sized by the source's expressions, which
    ``head_expressions`` took only where they give every traced layer its own counts; a
    config field would give them all one count, and refuses."""
    counts = sorted({(f.attention.num_heads, f.attention.num_kv_heads) for f in attention_layers(per_layer)})
    if len(counts) == 1:
        return
    heads_differ = len({heads for heads, _ in counts}) > 1
    kv_differ = len({kv for _, kv in counts}) > 1
    if (attention.heads_expr or not heads_differ) and (attention.kv_heads_expr or not kv_differ):
        return
    fields = [f"config.{f}" for f in (attention.heads_field, attention.kv_heads_field) if f]
    why = (
        f"{' and '.join(fields)} would give them all one"
        if fields
        else "no expression of the source gives each its own"
    )
    refuse(
        "uniform_layers", f"layers differ in their head counts {counts}, and {why}", attention.module_class
    )
