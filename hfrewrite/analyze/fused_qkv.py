"""A checkpoint-fused q/k/v projection (one Linear for all three), proven on the values:
``[q; k; v]`` blocks sliced or split (through elementwise ops such as dbrx's clamp), or
interleaved per head (gpt_neox). Used by ``attention.py``."""

from __future__ import annotations

import inspect
import linecache
import operator

import torch
from torch.fx import Node

from hfrewrite.analyze.dataflow import ancestors, linears_feeding, path_nodes, rope_start
from hfrewrite.analyze.gqa_expansion import expanded_from
from hfrewrite.analyze.plan import LinearFact, Refusal, refuse
from hfrewrite.analyze.qkv_layouts import KV_ORDER, QKV_ORDER, QkvLayout
from hfrewrite.analyze.trace import Traced, value


def fused_qkv(traced: Traced, path: str, scope: set[Node], args: dict, no_group: Refusal):
    """A checkpoint-fused projection: one Linear whose output's last dim is sliced into
    q ``[0, Q)``, k ``[Q, Q+K)`` and v ``[Q+K, Q+2K)`` (phi3's ``qkv_proj``), the layout
    vLLM's ``QKVParallelLinear`` loads from one tensor. Feeders are the slices; facts
    are per role, as if the projection were three. Else ``no_group`` is the reason."""
    found = {role: linears_feeding(arg, scope, traced) for role, arg in args.items()}
    linears = {n for nodes in found.values() for n in nodes}
    q_only = [n for n in found["q"] if n not in found["v"]]
    q_width = value(args["q"]).shape[1] * value(args["q"]).shape[-1]  # [b, heads, s, d]
    if (
        len(linears) == 2
        and len(found["v"]) == 1
        and found["v"][0] in found["k"]
        and len(q_only) == 1
        and traced.linear_fact(q_only[0], path).out_features == q_width  # q's own projection
    ):
        return _q_beside_kv(traced, path, scope, args, q_only[0], found["v"][0])
    if len(linears) != 1 or any(len(nodes) != 1 for nodes in found.values()):
        raise no_group
    (proj,) = linears
    whole = traced.linear_fact(proj, path)
    ranges, feeders = {}, {}
    for role, arg in args.items():
        cuts = [u for u in proj.users if u in ancestors(arg, scope) and _op(u, (operator.getitem,))]
        index = cuts[0].args[1] if len(cuts) == 1 else None
        last = index[-1] if isinstance(index, tuple) and index and index[0] is Ellipsis else None
        if isinstance(last, slice) and last.step in (None, 1):
            ranges[role] = last.indices(whole.out_features)[:2]
            feeders[role] = cuts[0]
        elif (part := _split_part(proj, arg, scope)) is not None:
            feeders[role], ranges[role] = part
        else:
            return _per_head_qkv(traced, path, scope, args, proj, whole)
    (q0, q1), (k0, k1), (v0, v1) = ranges["q"], ranges["k"], ranges["v"]
    if not (q0 == 0 and q1 == k0 and k1 == v0 and v1 == whole.out_features and k1 - k0 == v1 - v0):
        refuse("fuse_qkv", f"{whole.attr} is not laid out [q; k; v] ({ranges})")
    facts = [
        LinearFact(whole.attr, whole.in_features, b - a, whole.bias) for a, b in (ranges[r] for r in "qkv")
    ]
    return feeders, facts, QkvLayout.BLOCKS, ()


def _split_part(proj: Node, arg: Node, scope: set[Node]) -> tuple[Node, tuple[int, int]] | None:
    """``proj(x).split(sizes, dim=-1)[i]`` (or ``chunk``) on the way to ``arg``: that part
    and the range of the projection's last dim it holds (checked on the values)."""
    on_path = set(ancestors(arg, scope))
    split_from = _past_elementwise(proj, on_path)
    splits = [
        u for u in split_from.users if u in on_path and _op(u, ("split", "chunk", torch.split, torch.chunk))
    ]
    parts = [g for g in splits[0].users if g in on_path and _op(g, (operator.getitem,))] if splits else []
    if len(splits) != 1 or len(parts) != 1 or not isinstance(parts[0].args[1], int):
        return None
    pieces, whole = value(splits[0]), value(split_from)
    if not (isinstance(pieces, (tuple, list)) and torch.equal(torch.cat(list(pieces), dim=-1), whole)):
        return None
    i = parts[0].args[1]
    start = sum(piece.shape[-1] for piece in pieces[:i])
    return parts[0], (start, start + pieces[i].shape[-1])


# Elementwise ops with constant operands that a fused projection's output may pass through
# before its split (dbrx's clip_qkv clamp): on the whole or on each part, the same values.
# The rewrite carries the source's statements between the projection and the split.
QKV_ELEMENTWISE = ("clamp", "clip", torch.clamp, torch.clip)


def _past_elementwise(proj: Node, on_path: set[Node]) -> Node:
    """The end of the chain of ``QKV_ELEMENTWISE`` ops on ``proj`` along ``on_path``."""
    node = proj
    while True:
        after = [
            u
            for u in node.users
            if u in on_path
            and _op(u, QKV_ELEMENTWISE)
            and u.args[0] is node
            and not any(isinstance(a, Node) for a in (*u.args[1:], *u.kwargs.values()))
        ]
        if len(after) != 1 or value(after[0]).shape != value(node).shape:
            return node
        node = after[0]


def _per_head_qkv(
    traced: Traced,
    path: str,
    scope: set[Node],
    args: dict,
    proj: Node,
    whole: LinearFact,
):
    """One Linear whose output's q, k and v lanes the source takes apart by layout alone
    (views, indexing, einops), proven on the values: each role's head-shaped value (before
    any rope) is its lane of the projection in one of the layouts ``QKV_ORDER`` lists
    (analyze/qkv_layouts.py).
    "per_head" and "grouped" are reordered into [q; k; v] when loaded. The source line
    where each role's own value is first taken is recorded for the rewrite (the statement
    binding it becomes that role of vLLM's split)."""
    out = value(proj)
    xs = {role: rope_start(args[role], proj, scope) or args[role] for role in "qkv"}
    shapes = [value(x).shape if torch.is_tensor(value(x)) else None for x in xs.values()]
    if out.dim() != 3 or any(s is None or len(s) != 4 for s in shapes):
        refuse("fuse_qkv", f"{whole.attr} feeds q, k and v in a layout this analysis does not know")
    heads = {role: _heads_of(value(x), out) for role, x in xs.items()}
    d = value(xs["q"]).shape[3]
    kv, groups = (out.shape[-1] // d - heads["q"]) // 2, {"q": 1, "k": 1, "v": 1}
    if heads["k"] == heads["v"] == heads["q"] != kv and all(
        expanded_from(value(xs[r]), _head_axis(value(xs[r]), out), kv) for r in "kv"
    ):  # k and v expanded to every query head before the attention (Falcon-40B's broadcast_to)
        heads["k"] = heads["v"] = kv
        groups |= {"k": heads["q"] // kv, "v": heads["q"] // kv}  # their lanes, repeated alike
    if (heads["q"] + 2 * heads["k"]) * d != out.shape[-1] or heads["k"] != heads["v"] or not heads["k"]:
        refuse("fuse_qkv", f"{whole.attr} feeds q, k and v in a layout this analysis does not know")
    for kind in QKV_ORDER:
        lanes = kind.lanes(out, heads["q"], heads["k"], d)
        if lanes is not None and all(
            _on_path(xs[r], proj, scope, lane, groups[r]) for r, lane in zip("qkv", lanes)
        ):
            break
    else:
        refuse("fuse_qkv", f"{whole.attr} feeds q, k and v, neither as [q; k; v] nor per head")
    forward = forward_code(traced, path)
    own = [_first_own(proj, xs[r], [xs[o] for o in "qkv" if o != r], scope) for r in "qkv"]
    lines = tuple(next((line for n in nodes if (line := source_line(n, forward))), "") for nodes in own)
    if len(set(lines)) < 3:  # one statement takes several roles' pieces (CodeGen's torch.split)
        lines = tuple(f"{line}{ITEM}{_item(nodes)}" for line, nodes in zip(lines, own))
    facts = [LinearFact(whole.attr, whole.in_features, heads[r] * d, whole.bias) for r in "qkv"]
    return {r: proj for r in "qkv"}, facts, kind, lines


def _q_beside_kv(traced: Traced, path: str, scope: set[Node], args: dict, q_proj: Node, kv_proj: Node):
    """A q projection of its own beside one Linear holding k and v (TeleChat's ``query`` and
    ``key_value``): k and v are lanes of its output, as ``[k; v]`` blocks ("kv_blocks") or per
    kv head ``[h: k, v]`` ("kv_per_head"), proven on the values (analyze/qkv_layouts.py). Facts are per role."""
    out, d = value(kv_proj), value(args["q"]).shape[-1]
    kv = traced.linear_fact(kv_proj, path)
    xs = {role: rope_start(args[role], kv_proj, scope) or args[role] for role in "kv"}
    if out.dim() == 3 and out.shape[-1] % (2 * d) == 0:
        hk = out.shape[-1] // (2 * d)
        for kind in KV_ORDER:
            lanes = kind.lanes(out, 0, hk, d)
            if all(_on_path(xs[r], kv_proj, scope, lane) for r, lane in zip("kv", lanes)):
                part = LinearFact(kv.attr, kv.in_features, hk * d, kv.bias)
                return (
                    {"q": q_proj, "k": kv_proj, "v": kv_proj},
                    [traced.linear_fact(q_proj, path), part, part],
                    kind,
                    (),
                )
    refuse("fuse_qkv", f"{kv.attr} feeds k and v neither as [k; v] nor per kv head")


def _heads_of(x, out) -> int:
    """The head count of a head-shaped value [b, heads, s, d] or [b, s, heads, d]."""
    return x.shape[_head_axis(x, out)]


def _head_axis(x, out) -> int:
    return 2 if x.shape[1] == out.shape[1] and x.shape[2] != out.shape[1] else 1


def _on_path(x: Node, proj: Node, scope: set[Node], lane, groups: int = 1) -> bool:
    """The lane is a value on the path from the projection to ``x``, in either layout (with
    ``groups``: each of its heads repeated for its group of query heads)."""
    lane = lane.repeat_interleave(groups, dim=2)
    for v in (value(n) for n in [*path_nodes(x, proj, scope), x]):
        if torch.is_tensor(v) and any(
            v.shape == lv.shape and torch.equal(v, lv) for lv in (lane, lane.transpose(1, 2))
        ):
            return True
    return False


def _first_own(proj: Node, x: Node, others: list[Node], scope: set[Node]) -> list[Node]:
    """The nodes on the path to ``x`` that no other role's path shares, in graph order: the
    first one's source line is where the source takes this role's lane."""
    shared = set().union(*(path_nodes(o, proj, scope) for o in others))
    order = {n: i for i, n in enumerate(proj.graph.nodes)}
    return sorted(
        (n for n in [*path_nodes(x, proj, scope), x] if n not in shared and n is not proj), key=order.get
    )


# Between a line and the element of its tuple target that takes the role's lane, when one
# line takes several roles' (``query, value, key = torch.split(...)``).
ITEM = "  # item "


def _item(own: list[Node]) -> int | str:
    """The position, in a split's results, of the role's first own node ("?" if it is none)."""
    first = own[0] if own else None
    if _op(first, (operator.getitem,)) and isinstance(first.args[1], int):
        return first.args[1]
    return "?"


def forward_code(traced: Traced, path: str):
    """The code object of the forward of submodule ``path`` (what ``source_line`` reads)."""
    return inspect.unwrap(type(traced.module.get_submodule(path)).forward).__code__


def source_line(node: Node, code) -> str:
    """The source line (stripped) function ``code`` was executing when ``node`` was traced."""
    lineno = node.meta.get("lines", {}).get(code)
    return linecache.getline(code.co_filename, lineno).strip() if lineno else ""


def _op(node: object, ops: tuple) -> bool:
    return isinstance(node, Node) and node.op in ("call_function", "call_method") and node.target in ops
