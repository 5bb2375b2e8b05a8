"""Data-flow questions the attention and MLA rules ask of a traced graph: what a node is
computed from, which linears feed or read it, where the rope starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.fx import Node

from hfrewrite.analyze.linear_classes import is_linear as computes_linear

if TYPE_CHECKING:  # trace.py reads ancestors() from here
    from hfrewrite.analyze.trace import Traced


def ancestors(node: Node, scope: set[Node] | None) -> list[Node]:
    """``node`` and what it is computed from inside ``scope`` (None: anywhere)."""
    seen, order, todo = {node}, [node], [node]
    while todo:
        for arg in todo.pop(0).all_input_nodes:
            if (scope is None or arg in scope) and arg not in seen:
                seen.add(arg)
                order.append(arg)
                todo.append(arg)
    return order


def is_linear(node: Node, traced: Traced) -> bool:
    return node.op == "call_module" and computes_linear(traced.submodule(node))


def linears_feeding(node: Node, scope: set[Node], traced: Traced) -> list[Node]:
    """The Linear nodes ``node`` is computed from, not looking past a Linear."""
    seen, found, todo = {node}, [], [node]
    while todo:
        cur = todo.pop(0)
        if is_linear(cur, traced):
            found.append(cur)
            continue
        for arg in cur.all_input_nodes:
            if arg in scope and arg not in seen:
                seen.add(arg)
                todo.append(arg)
    return found


def linears_fed_by(node: Node, scope: set[Node], traced: Traced) -> list[Node]:
    """The Linear nodes computed from ``node``, not looking past a Linear."""
    seen, found, todo = {node}, [], list(node.users)
    while todo:
        cur = todo.pop(0)
        if cur in seen or cur not in scope:
            continue
        seen.add(cur)
        if is_linear(cur, traced):
            found.append(cur)
        else:
            todo.extend(cur.users)
    return found


def path_nodes(node: Node, source: Node, scope: set[Node]) -> list[Node]:
    """Nodes between ``source`` and ``node`` (both excluded) on the data flow."""
    return [
        n
        for n in ancestors(node, scope)
        if n is not node and n is not source and source in ancestors(n, scope)
    ]


def rope_start(arg: Node, source: Node, scope: set[Node]) -> Node | None:
    """``x``, the last position-independent value every path from ``source`` (the
    projection) to ``arg`` (the attention input) passes through, when ``arg`` depends on
    the positions (a rope region lies between them); None when it does not."""
    order = {n: i for i, n in enumerate(source.graph.nodes)}
    # (not the sizes read off another role: GPT-NeoX-Japanese views k by q's sizes)
    path = sorted([*(n for n in path_nodes(arg, source, scope) if not _sizes(n)), arg], key=order.__getitem__)
    on_path = set(path) | {source}
    mixed: set[Node] = set()
    for n in path:  # graph order: inputs first
        if any(
            a in mixed or (a not in on_path and _tensor(a) and _position_source(a)) for a in n.all_input_nodes
        ):
            mixed.add(n)
    if arg not in mixed:
        return None
    # a tensor: not the tuple of a split that the rope takes halves of (gpt_oss's torch.chunk)
    candidates = [n for n in [source, *path] if n not in mixed and torch.is_tensor(n.meta.get("value"))]
    for x in reversed(candidates):  # nearest to arg first
        if not reaches(source, arg, on_path - {x}):
            return x
    return source


def _sizes(node: Node) -> bool:
    """A size or a tuple of sizes: it carries none of the values it was read off."""
    val = node.meta.get("value")
    return isinstance(val, int) or (
        isinstance(val, tuple) and bool(val) and all(isinstance(v, int) for v in val)
    )


def _tensor(node: Node) -> bool:
    """A tensor value: sizes read off a layer input (``bsz, q_len = x.size()``) carry none
    of its values, and a view by them mixes in no position."""
    return torch.is_tensor(node.meta.get("value"))


def _position_source(node: Node) -> bool:
    """Computed from a layer input (positions, a rope table given), or from an ``arange``
    over sizes: the positions 0..seq-1 of a rope table built from the sequence length alone
    (ERNIE-4.5's remote code), or from a tensor the trace captured as a constant (the rows
    0..seq-1 of a cos/sin cache the module sliced by lengths outside the graph: OpenELM's),
    which prove_rope replays. One walk of its ancestors."""
    return any(
        n.op == "placeholder"
        or (n.op == "call_function" and n.target is torch.arange)
        or (n.op == "get_attr" and str(n.target).startswith(_CAPTURED))
        for n in ancestors(node, None)
    )


# how torch.fx names a tensor computed outside the graph that the graph then reads
_CAPTURED = "_tensor_constant"


def reaches(source: Node, target: Node, allowed: set[Node]) -> bool:
    """Whether data flows from ``source`` to ``target`` through ``allowed`` nodes only."""
    if source not in allowed:
        return False
    seen, todo = {source}, [source]
    while todo:
        for user in todo.pop().users:
            if user is target:
                return True
            if user in allowed and user not in seen:
                seen.add(user)
                todo.append(user)
    return False
