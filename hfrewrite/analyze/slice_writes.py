"""A tensor assembled by writes into an empty one, read as the concatenation it is.

DeepSeek-V3's Hub code builds q and k as ``x = t.new_empty(b, h, s, d)`` and then writes
``x[..., :n] = nope`` and ``x[..., n:] = pe`` (the rope part broadcast over heads). The
traced graph then has q and k computed from nothing but sizes, with the data in
``operator.setitem`` nodes beside them. Each such tensor whose writes tile its last dim in
order, and that nothing reads before the last write, is replaced by
``torch.cat([part.expand(...), ...], dim=-1)`` of the written values; the traced value must
equal the concatenation, else the graph stays as it was.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from hfrewrite.analyze.trace import Traced, value

_EMPTY = ("new_empty", "new_zeros", torch.empty, torch.zeros)


def fold_slice_writes(traced: Traced) -> int:
    """Replace each proven assembly; how many were replaced."""
    graph, order = traced.graph, {n: i for i, n in enumerate(traced.graph.nodes)}
    folded = 0
    for node in [n for n in graph.nodes if n.op in ("call_function", "call_method") and n.target in _EMPTY]:
        writes = sorted((u for u in node.users if _is_write(u, node)), key=order.get)
        reads = [u for u in node.users if u not in writes]
        whole = value(node)
        if (
            not writes
            or not reads
            or not torch.is_tensor(whole)
            or any(order[r] < order[writes[-1]] for r in reads)
        ):
            continue
        spans = [_last_dim_span(w.args[1], whole) for w in writes]
        if not _tiles(spans, whole.shape[-1]):
            continue
        parts = []
        with graph.inserting_before(min(reads, key=order.get)):  # in order, before the first read
            for write, (start, stop) in zip(writes, spans):
                part, shape = write.args[2], (*whole.shape[:-1], stop - start)
                if not isinstance(part, Node) or not torch.is_tensor(value(part)):
                    break
                if tuple(value(part).shape) != shape:  # broadcast by the write (DeepSeek's k_pe)
                    part = graph.call_method("expand", (part, *shape))
                    part.meta.update(write.args[2].meta, value=value(write.args[2]).expand(shape))
                parts.append(part)
            else:
                cat = graph.call_function(torch.cat, (parts, -1))
                cat.meta.update(node.meta, value=torch.cat([value(p) for p in parts], dim=-1))
        made = [p for p in parts if p not in (w.args[2] for w in writes)]
        if len(parts) != len(writes) or not torch.equal(value(cat), whole):
            for dead in ([cat] if len(parts) == len(writes) else []) + made[::-1]:
                graph.erase_node(dead)
            continue
        for read in reads:
            read.replace_input_with(node, cat)
        for write in writes:
            graph.erase_node(write)
        if not node.users:
            graph.erase_node(node)
        folded += 1
    if folded:
        traced.graph_module.recompile()
    return folded


def _is_write(user: Node, target: Node) -> bool:
    return user.op == "call_function" and user.target is operator.setitem and user.args[0] is target


def _last_dim_span(index: object, whole: torch.Tensor) -> tuple[int, int] | None:
    """(start, stop) of ``x[:, ..., :, a:b]`` (full slices, or an Ellipsis, before the last
    dim's slice), else None."""
    index = index if isinstance(index, tuple) else (index,)
    if not index or not isinstance(index[-1], slice) or index[-1].step not in (None, 1):
        return None
    full = slice(None)
    before = index[:-1]
    if before not in ((Ellipsis,), tuple([full] * (whole.dim() - 1))):
        return None
    return index[-1].indices(whole.shape[-1])[:2]


def _tiles(spans: list, size: int) -> bool:
    at = 0
    for span in spans:
        if span is None or span[0] != at or span[1] <= at:
            return False
        at = span[1]
    return at == size
