"""The ``--explain`` rows of the attention rewrite (passes/vllm_attention.py): the replacement
itself, then what it keeps of the source or builds beside vLLM's ``Attention``."""

from __future__ import annotations

from hfrewrite.analyze.plan import AttentionPlan
from hfrewrite.emit.after_split import positionless

# what the q/k norms normalise over, in the explain row
_NORMED_OVER = {
    "head": "head",
    "each_head": "head, weights per head: each rank its own heads",
    "all_heads": "all_heads",
}


def replacement_row(att: AttentionPlan, hybrid: bool = False) -> str:
    """The ``--explain`` row of the attention's replacement: what ran, and its positions."""
    style = att.rope_style.label
    rope = (
        f"{att.rope_turn.builds} ({att.rope_turn.how}{style} style, rotary dim {att.rotary_dim} of {att.head_dim}"
        + (", parameters per layer type" if att.rope_per_layer_type else "")
        + "; proven by replay)"
    )
    softcap = f", logit soft cap {att.logit_softcap:g}" if att.logit_softcap else ""
    if att.alibi:
        rope = f"ALiBi slopes x {att.alibi} (bias proven by replay)"
    elif positionless(att) and hybrid:
        rope = "no rope (the hybrid's other mixer sees the order)"
    elif positionless(att):
        rope = "no rope (learned or fixed positions added to the embeddings)"
    called = att.attention_call.label
    window = "; windows read off the mask buffer" if att.window_mask else ""
    return f"{called} -> vllm Attention{softcap} + {rope}{window}"


def kept_rows(att: AttentionPlan) -> list[str]:
    """The rows of what the file builds beside ``Attention`` or keeps from the source."""
    rows = []
    if att.attention_chunk:
        rows.append("chunked layers -> ChunkedLocalAttention (masks checked)")
    if att.sinks:
        rows.append(f"{att.sinks} -> Attention(sinks=...), one per head of each rank")
    if att.output_gate is not None:
        rows.append(f"output gate kept: {att.output_gate.describe()} (proven by replay)")
    if att.output_norm:
        rows.append(
            f"{att.output_norm} kept over the whole output, the ranks' heads gathered (proven per token)"
        )
    if att.q_norm:
        over, where = _NORMED_OVER[att.qk_norm_over], att.qk_norm_order.value
        rows.append(f"{att.q_norm}/{att.k_norm} kept (over {over}, {where} the rope)")
    return rows
