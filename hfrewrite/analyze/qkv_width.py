"""A checkpoint layout of q, k and v proven at a second head count.

The shrunk model has four query heads. A layout that reorders the checkpoint's rows
(analyze/qkv_layouts.py) can coincide with another at that count: CodeGen's four blocks
of ``[q; v; k]`` are, at four heads, one head per block, and read as a per-head layout.
The file reorders a real checkpoint, with its own head count, by the row's formula; so
the same row must also be what the source computes with twice the heads, where such
layouts come apart.
"""

from __future__ import annotations

from collections.abc import Callable

from hfrewrite.analyze.plan import AttentionPlan, Refusal, refuse
from hfrewrite.analyze.shrink import HEADS

WIDER = 2 * HEADS


def prove_at_more_heads(attention, layout_at: Callable[[int], object]) -> None:
    """Refuse unless ``layout_at(WIDER)``, the q/k/v layout the analysis finds with
    ``WIDER`` query heads, is ``attention``'s own (for a layout reordered at load)."""
    if not isinstance(attention, AttentionPlan) or attention.qkv_layout is None:
        return
    if not attention.qkv_layout.load_helper:
        return
    try:
        other = layout_at(WIDER)
    except Refusal as e:
        other, why = None, f": {e.no_match.reason}"
    else:
        why = f" ({other.report})" if other is not None else " (three linears)"
    if other is not attention.qkv_layout:
        refuse(
            "fuse_qkv",
            f"{attention.q.attr} is laid out as {attention.qkv_layout.report} with {HEADS} heads, "
            f"but not with {WIDER}{why}: a layout that depends on the head count",
            attention.module_class,
        )
