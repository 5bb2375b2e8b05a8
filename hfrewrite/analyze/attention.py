"""Attention facts: the q/k/v/o projections, heads, per-head norms, rope, scaling.

Pattern (llama family, traced inline inside the decoder layer)::

    q = q_proj(x) -> view/transpose [-> q_norm] [-> x * cos + rotate_half(x) * sin]
    k alike; v = v_proj(x) -> view/transpose (no norm, no rope)
    out = o_proj(reshape(attention(q, k, v, scaling=..., sliding_window=...)))

The q/k/v roles come from data flow into the attention leaf's arguments, not from
attribute names. vLLM emits ``QKVParallelLinear`` + ``get_rope`` + ``Attention``.

Preconditions (fail closed, each a NoMatch with a reason): exactly one group of three
Linears reading the same input, each called once, feeding the leaf's q, k and v one
each; k and v equal in out_features; one bias setting; out_features equal to heads times
head_dim; at most one norm per q/k path, before the rope; rope on both q and k or on
neither; exactly one Linear consumes the attention output and it ends the block; no
attention keyword that changes the math (softcap, sinks...).
"""

from __future__ import annotations

import operator

import torch
from torch import nn
from torch.fx import Node

from hfrewrite.analyze.rope import per_layer_type, prove_rope
from hfrewrite.analyze.plan import AttentionPlan, LinearFact, NoMatch
from hfrewrite.analyze.trace import (
    Traced,
    is_norm,
    opaque_attention,
    past_identity_dropouts,
    relative,
    value,
)

# Keywords of the attention call that do not change its math (at inference); any other
# keyword must be None or False (flags like output_router_logits pass through **kwargs).
_HARMLESS_KWARGS = frozenset(
    {
        "dropout",
        "scaling",
        "sliding_window",
        "position_ids",
        "use_cache",
        "cache_position",
        "past_key_values",
        "output_attentions",
        "softcap",  # vLLM Attention(logits_soft_cap=...), from the same expression
    }
)


class _Declined(Exception):
    def __init__(self, pattern: str, reason: str) -> None:
        super().__init__(reason)
        self.pattern, self.reason = pattern, reason


def analyze_attention(traced: Traced, path: str, config, layer_type: str | None = None
                      ) -> AttentionPlan | NoMatch:
    """Facts of the attention submodule ``path`` ("" = the root) of a traced module;
    ``config``: the traced model's config (its rope parameters), ``layer_type``: the
    traced layer's entry of ``config.layer_types``."""
    cls = type(traced.module.get_submodule(path)).__name__
    try:
        return _analyze(traced, path, cls, config, layer_type)
    except _Declined as d:
        return NoMatch(d.pattern, cls, d.reason)


def _analyze(traced: Traced, path: str, cls: str, config, layer_type: str | None) -> AttentionPlan:
    scope = set(traced.nodes_in(path))
    call = _attention_call(traced, path)
    args = dict(zip("qkv", call.args[1:4]))
    try:
        group = _qkv_group(traced, path)
    except _Declined as no_group:
        feeders, (q, k, v), fused = _fused_qkv(traced, path, scope, args, no_group)
    else:
        feeders = {
            role: _feeder(traced, path, scope, arg, group, role)
            for role, arg in args.items()
        }
        if len(set(feeders.values())) != 3:
            raise _Declined(
                "fuse_qkv", "q, k and v do not come from three different linears"
            )
        q, k, v = (traced.linear_fact(feeders[role], path) for role in "qkv")
        fused = None
    if k.out_features != v.out_features:
        raise _Declined(
            "fuse_qkv",
            f"{k.attr} and {v.attr} differ in out_features "
            f"({k.out_features} != {v.out_features})",
        )
    if not q.bias == k.bias == v.bias:
        raise _Declined("fuse_qkv", f"{q.attr}, {k.attr} and {v.attr} differ in bias")
    num_heads, num_kv_heads, head_dim = _heads(args, q, k)

    rope_in = {role: _rope_start(arg, feeders[role], scope) for role, arg in args.items()}
    if rope_in["v"] is not None or (rope_in["q"] is None) != (rope_in["k"] is None):
        raise _Declined(
            "vllm_attention", "a position-dependent op is not applied to exactly q and k"
        )
    for role in "qkv":  # projection -> rope (or attention): layout, casts, norms only
        stop = rope_in[role] if rope_in[role] is not None else args[role]
        _only_layout([*_path_nodes(stop, feeders[role], scope), stop], traced, f"the {role} path")
    rope, norm_after = None, None
    if rope_in["q"] is not None:
        rope = prove_rope([(rope_in[r], args[r]) for r in "qk"], config, head_dim, layer_type)
        ends = [args[r] for r in "qk"]
        if isinstance(rope, str) and all(n.op == "call_module" and is_norm(traced.submodule(n)) for n in ends):
            # q/k norms right after the rope (hunyuan): the rope ends at their inputs
            after = prove_rope([(rope_in[r], args[r].args[0]) for r in "qk"], config, head_dim, layer_type)
            if not isinstance(after, str):
                rope, norm_after = after, {r: relative(args[r].target, path) for r in "qk"}
        if isinstance(rope, str):
            raise _Declined("vllm_attention", f"rotary embedding: {rope}")
    norms = {
        role: _head_norm(
            traced, path, scope, args[role], feeders[role], rope_in[role], role
        )
        for role in "qkv"
    }
    if norm_after is not None:
        if norms["q"] is not None or norms["k"] is not None:
            raise _Declined("vllm_attention", "q/k norms both before and after the rotary embedding")
        norms.update(norm_after)
    if norms["v"] is not None:
        raise _Declined("vllm_attention", f"a norm ({norms['v']}) on the v path")
    if (norms["q"] is None) != (norms["k"] is None):
        raise _Declined("vllm_attention", "a norm on only one of the q and k paths")
    qk_norm_over = None
    if norms["q"] is not None:
        # the width each norm normalises over: its input's last dim (weightless norms too)
        widths = {
            value(n.args[0]).shape[-1]
            for n in traced.graph.nodes
            if n.op == "call_module" and n.target in {f"{path}.{norms[r]}" for r in "qk"}
        }
        if widths == {head_dim}:
            qk_norm_over = "head"
        elif widths <= {num_heads * head_dim, num_kv_heads * head_dim}:
            qk_norm_over = "all_heads"
        else:
            reason = f"q/k norm widths {sorted(widths)} are neither head_dim nor all heads"
            raise _Declined("vllm_attention", reason)

    if fused is None:
        heads = {"q": num_heads, "k": num_kv_heads, "v": num_kv_heads}
        for role in "qkv":
            before_rope = None if norm_after is not None else norms[role]
            _prove_head_layout(traced, path, feeders[role], rope_in[role] or args[role], heads[role], head_dim,
                               before_rope, qk_norm_over, role)
    o_node = _output_projection(traced, path, scope, call)
    _only_layout(_path_nodes(o_node, call, scope), traced, "the attention output")
    _prove_output_layout(call, o_node)
    for key in sorted(set(call.kwargs) - _HARMLESS_KWARGS):
        passed = value(call.kwargs[key])
        if passed is not None and passed is not False:
            tensor = torch.is_tensor(passed)
            shown = f"<{tuple(passed.shape)} tensor>" if tensor else repr(passed)
            reason = f"the attention call passes {key}={shown}"
            raise _Declined("vllm_attention", reason)
    if value(call.kwargs.get("dropout", 0.0)):
        raise _Declined("vllm_attention", "attention dropout is not 0 at inference")
    softcap = value(call.kwargs.get("softcap"))
    scaling = value(call.kwargs.get("scaling"))
    window = value(call.kwargs.get("sliding_window"))
    return AttentionPlan(
        module_class=cls,
        q=q,
        k=k,
        v=v,
        o=traced.linear_fact(o_node, path),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        q_norm=norms["q"],
        k_norm=norms["k"],
        rope=rope is not None,
        rope_neox=rope.neox if rope else True,
        rope_reversed=rope.reversed if rope else False,
        rotary_dim=rope.rotary_dim if rope else head_dim,
        scaling=float(head_dim**-0.5 if scaling is None else scaling),
        sliding_window=None if window is None else int(window),
        qk_norm_over=qk_norm_over,
        logit_softcap=None if softcap is None else float(softcap),
        rope_per_layer_type=per_layer_type(config),
        fused_qkv=fused is not None,
        qkv_per_head=fused == "per_head",
        qk_norm_after_rope=norm_after is not None,
    )


def _qkv_group(traced: Traced, path: str) -> list[Node]:
    """The one group of three Linears reading the same input, each called once."""
    linears = traced.linears_in(path)
    names = [relative(n.target, path) for n in linears]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise _Declined("fuse_qkv", f"{', '.join(repeated)} called more than once")
    groups: dict[Node, list[Node]] = {}  # insertion (graph) order
    for n in linears:
        groups.setdefault(n.args[0], []).append(n)
    triples = [g for g in groups.values() if len(g) == 3]
    if len(triples) != 1:
        raise _Declined(
            "fuse_qkv",
            f"{_count(len(triples))} group of three linears reading the same input",
        )
    return triples[0]


def _fused_qkv(traced: Traced, path: str, scope: set[Node], args: dict, no_group: _Declined):
    """A checkpoint-fused projection: one Linear whose output's last dim is sliced into
    q ``[0, Q)``, k ``[Q, Q+K)`` and v ``[Q+K, Q+2K)`` (phi3's ``qkv_proj``), the layout
    vLLM's ``QKVParallelLinear`` loads from one tensor. Feeders are the slices; facts
    are per role, as if the projection were three. Else ``no_group`` is the reason."""
    found = {role: _linears_feeding(arg, scope, traced) for role, arg in args.items()}
    linears = {n for nodes in found.values() for n in nodes}
    if len(linears) != 1 or any(len(nodes) != 1 for nodes in found.values()):
        raise no_group
    (proj,) = linears
    whole = traced.linear_fact(proj, path)
    ranges, feeders = {}, {}
    for role, arg in args.items():
        cuts = [u for u in proj.users if u in _ancestors(arg, scope) and _op(u, (operator.getitem,))]
        index = cuts[0].args[1] if len(cuts) == 1 else None
        last = index[-1] if isinstance(index, tuple) and index and index[0] is Ellipsis else None
        if not isinstance(last, slice) or last.step not in (None, 1):
            return _per_head_qkv(traced, path, scope, args, proj, whole)
        ranges[role] = last.indices(whole.out_features)[:2]
        feeders[role] = cuts[0]
    (q0, q1), (k0, k1), (v0, v1) = ranges["q"], ranges["k"], ranges["v"]
    if not (q0 == 0 and q1 == k0 and k1 == v0 and v1 == whole.out_features and k1 - k0 == v1 - v0):
        raise _Declined("fuse_qkv", f"{whole.attr} is not laid out [q; k; v] ({ranges})")
    facts = [LinearFact(whole.attr, whole.in_features, b - a, whole.bias) for a, b in (ranges[r] for r in "qkv")]
    return feeders, facts, "blocks"


def _per_head_qkv(traced: Traced, path: str, scope: set[Node], args: dict, proj: Node, whole: LinearFact):
    """One Linear whose output interleaves q, k and v per head (gpt_neox's
    ``query_key_value``: rows [h0: q k v][h1: q k v]...), proven on the values: each
    role's head-shaped value (before any rope) is its lane of ``view(b, s, heads, 3, d)``.
    The generated loader reorders the rows into [q; k; v] for ``QKVParallelLinear``."""
    out = value(proj)
    feeders, facts = {}, []
    for i, role in enumerate("qkv"):
        x = _rope_start(args[role], proj, scope) or args[role]
        xv = value(x)
        if not (torch.is_tensor(xv) and xv.dim() == 4 and out.dim() == 3
                and 3 * xv.shape[1] * xv.shape[3] == out.shape[-1]):
            raise _Declined("fuse_qkv", f"{whole.attr} feeds q, k and v in a layout this analysis does not know")
        heads, d = xv.shape[1], xv.shape[3]
        lane = out.reshape(*out.shape[:2], heads, 3, d)[..., i, :]  # [b, s, heads, d]
        # the lane is found on the path to the rope (before a per-head norm), in either layout
        path_values = [value(n) for n in [*_path_nodes(x, proj, scope), x]]
        if not any(torch.is_tensor(v) and any(v.shape == lv.shape and torch.equal(v, lv)
                                              for lv in (lane, lane.transpose(1, 2))) for v in path_values):
            raise _Declined("fuse_qkv", f"{whole.attr} feeds q, k and v, neither as [q; k; v] nor per head")
        feeders[role] = proj
        facts.append(LinearFact(whole.attr, whole.in_features, heads * d, whole.bias))
    return feeders, facts, "per_head"


# What may lie between a projection and the attention (and between the attention and the
# output projection) besides the proven rope and q/k norms: the rewrite re-derives the
# layout and drops these, so anything else (a scale, an activation) must refuse.
_LAYOUT_METHODS = {
    "view", "reshape", "transpose", "contiguous", "permute", "flatten", "unflatten", "unsqueeze",
    "squeeze", "to", "float", "type_as", "chunk", "split", "expand",
    "repeat_interleave", "repeat",  # kv heads repeated: the head counts must still agree
    "clamp", "clamp_", "clip", "clip_",  # a config's clip_qkv: the rewrite carries its `if`
}
_LAYOUT_FUNCTIONS = (operator.getitem, torch.transpose, torch.reshape, torch.chunk, torch.split,
                     torch.flatten, torch.clamp)


def _prove_head_layout(traced: Traced, path: str, proj: Node, head_shaped: Node, heads: int, head_dim: int,
                       norm: str | None, norm_over: str | None, role: str) -> None:
    """The layout ops between a projection and its head-shaped value (the rope's input,
    or the attention's) are the split vLLM assumes: ``[b, s, heads * d]`` ->
    ``[b, heads, s, d]``, head after head (through the q/k norm, if any), checked on
    the traced values: a transpose against head_dim has the same shape, not the values."""
    out, got = value(proj), value(head_shaped)
    if not (torch.is_tensor(out) and torch.is_tensor(got) and out.dim() == 3):
        raise _Declined("vllm_attention", f"the {role} projection's output is not [batch, seq, features]")
    b, s, _ = out.shape
    want = out
    with torch.no_grad():
        if norm is not None and norm_over == "all_heads":
            want = traced.module.get_submodule(f"{path}.{norm}" if path else norm)(want)
        want = want.reshape(b, s, heads, head_dim)
        if norm is not None and norm_over == "head":
            want = traced.module.get_submodule(f"{path}.{norm}" if path else norm)(want)
        want = want.transpose(1, 2)
    if got.shape != want.shape or not torch.allclose(got.double(), want.double(), atol=1e-6):
        raise _Declined("vllm_attention", f"the {role} path does not split the projection into heads as "
                                          "[heads, head_dim] (checked on the traced values)")


def _prove_output_layout(call: Node, o_node: Node) -> None:
    """The output projection reads the attention output ``[b, s, heads, d]`` as
    ``[b, s, heads * d]``, the layout vLLM's ``Attention`` returns (checked on values)."""
    out = value(call)
    out = out[0] if isinstance(out, (tuple, list)) else out
    got = value(o_node.args[0]) if o_node.args else None
    if not (torch.is_tensor(out) and torch.is_tensor(got) and out.dim() == 4):
        raise _Declined("vllm_attention", "the attention output is not [batch, seq, heads, head_dim]")
    want = out.reshape(*out.shape[:2], -1)
    if got.shape != want.shape or not torch.equal(got, want):
        raise _Declined("vllm_attention", "the output projection does not read the attention output as "
                                          "[heads * head_dim] per token (checked on the traced values)")


def _only_layout(nodes: list[Node], traced: Traced, what: str) -> None:
    for n in nodes:
        ok = ((n.op == "call_method" and n.target in _LAYOUT_METHODS)
              or (n.op == "call_function" and n.target in _LAYOUT_FUNCTIONS)
              or (n.op == "call_module" and is_norm(traced.submodule(n)))
              or n.op == "get_attr")
        if not ok:
            name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
            raise _Declined("vllm_attention", f"{what} computes {name}, which the rewrite would not keep")


def _op(node: object, ops: tuple) -> bool:
    return isinstance(node, Node) and node.op in ("call_function", "call_method") and node.target in ops


def _attention_call(traced: Traced, path: str) -> Node:
    calls = [
        n
        for n in traced.nodes_in(path)
        if n.op == "call_function" and n.target is opaque_attention
    ]
    if not calls:
        raise _Declined("vllm_attention", "no call through the attention interface: a linear-attention or "
                                          "recurrent mixer keeps state outside vLLM's KV cache")
    if len(calls) != 1:
        raise _Declined(
            "vllm_attention",
            f"{_count(len(calls))} call through the attention interface",
        )
    if not all(isinstance(a, Node) for a in calls[0].args[1:4]):
        raise _Declined(
            "vllm_attention", "q, k or v of the attention call is a constant"
        )
    return calls[0]


def _feeder(
    traced: Traced, path: str, scope: set[Node], arg: Node, group: list[Node], role: str
) -> Node:
    """The Linear of the q/k/v group that the attention's ``role`` input comes from."""
    found = _linears_feeding(arg, scope, traced)
    if len(found) != 1 or found[0] not in group:
        names = ", ".join(relative(n.target, path) for n in group)
        raise _Declined(
            "fuse_qkv",
            f"the attention's {role} input does not come from exactly one of {names}",
        )
    return found[0]


def _heads(args: dict, q: LinearFact, k: LinearFact) -> tuple[int, int, int]:
    """(heads, kv heads, head_dim) from the [batch, heads, seq, head_dim] values."""
    qv, kv, vv = (value(args[role]) for role in "qkv")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (qv, kv, vv)):
        raise _Declined(
            "vllm_attention", "q, k and v are not [batch, heads, seq, head_dim]"
        )
    heads, kv_heads, head_dim = qv.shape[1], kv.shape[1], qv.shape[3]
    if kv.shape[3] != head_dim or vv.shape[3] != head_dim or vv.shape[1] != kv_heads:
        raise _Declined(
            "vllm_attention",
            f"q, k and v shapes differ: {tuple(qv.shape)}, "
            f"{tuple(kv.shape)}, {tuple(vv.shape)}",
        )
    if q.out_features != heads * head_dim or k.out_features != kv_heads * head_dim:
        raise _Declined(
            "fuse_qkv", f"out_features are not heads * head_dim ({head_dim})"
        )
    if heads % kv_heads:
        raise _Declined(
            "vllm_attention", f"{heads} heads not divisible by {kv_heads} kv heads"
        )
    return heads, kv_heads, head_dim


def _head_norm(
    traced: Traced,
    path: str,
    scope: set[Node],
    arg: Node,
    source: Node,
    rope_in: Node | None,
    role: str,
) -> str | None:
    """The attribute of the one norm between a projection and the rope, or None."""
    norms = [
        n
        for n in _path_nodes(arg, source, scope)
        if n.op == "call_module" and is_norm(traced.submodule(n))
    ]
    if len(norms) > 1:
        raise _Declined("vllm_attention", f"{len(norms)} norms on the {role} path")
    if norms and rope_in is not None and norms[0] not in _ancestors(rope_in, scope):
        raise _Declined(
            "vllm_attention", f"the {role} norm is applied after the rotary embedding"
        )
    return relative(norms[0].target, path) if norms else None


def _output_projection(traced: Traced, path: str, scope: set[Node], call: Node) -> Node:
    """The one Linear that consumes the attention output and ends the block."""
    consumers = _linears_fed_by(call, scope, traced)
    if len(consumers) != 1:
        raise _Declined(
            "vllm_attention",
            f"{_count(len(consumers))} linear consumes the attention output",
        )
    if traced.outputs_of(path) != [past_identity_dropouts(consumers[0], traced, path)]:
        raise _Declined(
            "vllm_attention", "the output projection does not end the block"
        )
    return consumers[0]



def _count(n: int) -> str:
    return "no" if n == 0 else f"{n} instead of one"


def _ancestors(node: Node, scope: set[Node] | None) -> list[Node]:
    """``node`` and what it is computed from inside ``scope`` (None: anywhere)."""
    seen, order, todo = {node}, [node], [node]
    while todo:
        for arg in todo.pop(0).all_input_nodes:
            if (scope is None or arg in scope) and arg not in seen:
                seen.add(arg)
                order.append(arg)
                todo.append(arg)
    return order


def _is_linear(node: Node, traced: Traced) -> bool:
    return node.op == "call_module" and isinstance(traced.submodule(node), nn.Linear)


def _linears_feeding(node: Node, scope: set[Node], traced: Traced) -> list[Node]:
    """The Linear nodes ``node`` is computed from, not looking past a Linear."""
    seen, found, todo = {node}, [], [node]
    while todo:
        cur = todo.pop(0)
        if _is_linear(cur, traced):
            found.append(cur)
            continue
        for arg in cur.all_input_nodes:
            if arg in scope and arg not in seen:
                seen.add(arg)
                todo.append(arg)
    return found


def _linears_fed_by(node: Node, scope: set[Node], traced: Traced) -> list[Node]:
    """The Linear nodes computed from ``node``, not looking past a Linear."""
    seen, found, todo = {node}, [], list(node.users)
    while todo:
        cur = todo.pop(0)
        if cur in seen or cur not in scope:
            continue
        seen.add(cur)
        if _is_linear(cur, traced):
            found.append(cur)
        else:
            todo.extend(cur.users)
    return found


def _path_nodes(node: Node, source: Node, scope: set[Node]) -> list[Node]:
    """Nodes between ``source`` and ``node`` (both excluded) on the data flow."""
    return [
        n
        for n in _ancestors(node, scope)
        if n is not node and n is not source and source in _ancestors(n, scope)
    ]


def _rope_start(arg: Node, source: Node, scope: set[Node]) -> Node | None:
    """``x``, the last position-independent value every path from ``source`` (the
    projection) to ``arg`` (the attention input) passes through, when ``arg`` depends on
    the positions (a rope region lies between them); None when it does not."""
    order = {n: i for i, n in enumerate(source.graph.nodes)}
    path = sorted([*_path_nodes(arg, source, scope), arg], key=order.__getitem__)
    on_path = set(path) | {source}
    mixed: set[Node] = set()
    for n in path:  # graph order: inputs first
        if any(a in mixed or (a not in on_path and _from_layer_inputs(a)) for a in n.all_input_nodes):
            mixed.add(n)
    if arg not in mixed:
        return None
    candidates = [n for n in [source, *path] if n not in mixed]
    for x in reversed(candidates):  # nearest to arg first
        if not _reaches(source, arg, on_path - {x}):
            return x
    return source


def _from_layer_inputs(node: Node) -> bool:
    return any(n.op == "placeholder" for n in _ancestors(node, None))


def _reaches(source: Node, target: Node, allowed: set[Node]) -> bool:
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
