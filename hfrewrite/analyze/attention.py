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

from typing import NamedTuple

from torch.fx import Node

from hfrewrite.analyze.attention_options import call_options
from hfrewrite.analyze.block_output import adds_given_tensor, read_outputs
from hfrewrite.analyze.dataflow import (
    ancestors,
    linears_fed_by,
    linears_feeding,
    path_nodes,
    rope_start,
)
from hfrewrite.analyze.fused_qkv import fused_qkv
from hfrewrite.analyze.head_layout import (
    norm_through_layout,
    only_layout,
    prove_head_layout,
    prove_output_layout,
)
from hfrewrite.analyze.head_norms import own_weights_per_head
from hfrewrite.analyze.head_sizes import Heads, heads_of
from hfrewrite.analyze.leaf_modules import is_head_norm
from hfrewrite.analyze.manual_attention import by_hand_facts, no_attention_reason
from hfrewrite.analyze.norm_kinds import QkNormOrder
from hfrewrite.analyze.output_gate import output_gate
from hfrewrite.analyze.output_gates import OutputGate
from hfrewrite.analyze.output_norm import output_norm
from hfrewrite.analyze.path_scale import path_scales
from hfrewrite.analyze.plan import AttentionPlan, LinearFact, NoMatch, Refusal, RopeTable, refuse
from hfrewrite.analyze.position_scale import peel_position_scale
from hfrewrite.analyze.q_prescale import peel_q_prescale
from hfrewrite.analyze.replaced_calls import replaced_calls
from hfrewrite.analyze.rope import (
    RopeFact,
    computed_base_reason,
    legacy_rope_fields,
    per_layer_type,
    prove_rope,
    refuse_rope,
)
from hfrewrite.analyze.rope_styles import RopeLayers, RopeStyle, RopeTurn
from hfrewrite.analyze.rope_table import prove_rope_table
from hfrewrite.analyze.trace import (
    Traced,
    causal_sdpa,
    is_attention_leaf,
    past_identity_dropouts,
    relative,
    value,
)


def analyze_attention(
    traced: Traced, path: str, config, layer_type: str | None = None, layer_idx: int | None = None
) -> AttentionPlan | NoMatch:
    """Facts of the attention submodule ``path`` ("" = the root) of a traced module;
    ``config``: the traced model's config (its rope parameters), ``layer_type``: the
    traced layer's entry of ``config.layer_types``, ``layer_idx``: its index."""
    cls = type(traced.module.get_submodule(path)).__name__
    try:
        return _analyze(traced, path, cls, config, (layer_type, layer_idx))
    except Refusal as refusal:
        return refusal.at(cls)


def _analyze(
    traced: Traced, path: str, cls: str, config, layer: tuple[str | None, int | None]
) -> AttentionPlan:
    """``layer``: the traced layer's (entry of ``config.layer_types``, index)."""
    scope = set(traced.nodes_in(path))
    call = _attention_call(traced, path)
    args = dict(zip("qkv", call.args[1:4]))
    proj = _projections(traced, path, scope, args)
    if (prescale := peel_q_prescale(traced, path, proj.feeders["q"])) is not None:  # (OPT)
        proj = proj._replace(feeders={**proj.feeders, "q": prescale[0]})
    args["q"], q_scale = peel_position_scale(traced, path, scope, args["q"], proj.feeders["q"])
    heads = heads_of(args, proj)
    rope = _rope(traced, path, scope, args, proj.feeders, config, heads.head_dim, layer)
    norms = _norms(traced, path, scope, args, proj.feeders, rope)
    qk_norm_over = _qk_norm_over(traced, path, norms, heads)
    if proj.fused is None:
        _prove_head_layouts(traced, path, args, proj.feeders, rope, norms, heads, qk_norm_over)
    o_node, adds_residual, returned = _output_projection(traced, path, scope, call)
    gate, norm = _output_path(traced, path, scope, call, o_node, proj, heads)
    options = call_options(call, path, heads.num_heads)
    fact, fused, head_dim = rope.fact, proj.fused, heads.head_dim
    return AttentionPlan(
        module_class=cls,
        q=proj.q,
        k=proj.k,
        v=proj.v,
        o=traced.linear_fact(o_node, path),
        num_heads=heads.num_heads,
        num_kv_heads=heads.num_kv_heads,
        head_dim=head_dim,
        q_norm=norms["q"],
        k_norm=norms["k"],
        rope_layers=RopeLayers.NONE if fact is None else RopeLayers.ALL,
        rope_style=fact.style if fact else RopeStyle.NEOX,
        rope_turn=fact.turn if fact else RopeTurn.FORWARD,
        rotary_dim=fact.rotary_dim if fact else head_dim,
        **_scales(options.scaling, prescale, rope, heads),
        sliding_window=None if options.window is None else int(options.window),
        attention_chunk=options.chunk,
        qk_norm_over=qk_norm_over,
        logit_softcap=None if options.softcap is None else float(options.softcap),
        rope_per_layer_type=per_layer_type(config),
        rope_base_field=fact.base_field if fact else None,
        rope_fields=legacy_rope_fields(config) if fact else (),
        max_position_field=_max_position_field(config),
        rope_table=rope.table,
        qkv_layout=fused,
        qkv_unpack_lines=proj.unpack_lines,
        q_position_scale=q_scale,
        qk_norm_order=QkNormOrder.BEFORE_ROPE if rope.norm_after is None else QkNormOrder.AFTER_ROPE,
        replaced_calls=replaced_calls(traced, path, scope, proj.feeders, rope.ends, call, o_node),
        alibi=call.kwargs.get("alibi") if call.target is causal_sdpa else None,
        **by_hand_facts(call, path),
        sinks=options.sinks,
        adds_residual=adds_residual,
        returned_parameters=returned,
        output_gate=gate,
        output_norm=norm,
    )


def _scales(called: float | None, prescale: tuple | None, rope: _Rope, heads: Heads) -> dict:
    """The scale vLLM's attention runs at (the call's, or the default, times the numbers q
    and k are multiplied by), the source's expressions of those numbers, and v's head size
    where narrower."""
    scaling = heads.head_dim**-0.5 if called is None else called
    return {
        "scaling": float(scaling) * (prescale[1] if prescale else 1.0) * rope.scales.get("k", (None, 1.0))[1],
        "q_prescale": prescale[2] if prescale else None,
        "path_scales": tuple((role, expression) for role, (_, _, expression) in sorted(rope.scales.items())),
        "v_head_dim": heads.v_head_dim if heads.v_head_dim != heads.head_dim else None,
    }


class _Projections(NamedTuple):
    """The q/k/v projections, and the node each attention input comes from."""

    feeders: dict[str, Node]  # role -> its Linear (or its slice of a fused one)
    q: LinearFact
    k: LinearFact
    v: LinearFact
    fused: str | None  # the checkpoint-fused projection's layout (analyze/fused_qkv.py)
    unpack_lines: tuple[str, ...]


def _projections(traced: Traced, path: str, scope: set[Node], args: dict) -> _Projections:
    """Three Linears reading one input, or one fused projection; one size and bias for k and v."""
    try:
        group = _qkv_group(traced, path)
    except Refusal as no_group:
        feeders, (q, k, v), fused, unpack_lines = fused_qkv(traced, path, scope, args, no_group)
    else:
        feeders = {role: _feeder(traced, path, scope, arg, group, role) for role, arg in args.items()}
        if len(set(feeders.values())) != 3:
            refuse("fuse_qkv", "q, k and v do not come from three different linears")
        q, k, v = (traced.linear_fact(feeders[role], path) for role in "qkv")
        fused, unpack_lines = None, ()
    if k.out_features != v.out_features and (fused is not None or v.out_features > k.out_features):
        refuse(  # (a narrower v of its own: its head size, head_sizes.py)
            "fuse_qkv",
            f"{k.attr} and {v.attr} differ in out_features ({k.out_features} != {v.out_features})",
        )
    if not q.bias == k.bias == v.bias:
        refuse("fuse_qkv", f"{q.attr}, {k.attr} and {v.attr} differ in bias")
    return _Projections(feeders, q, k, v, fused, unpack_lines)


class _Rope(NamedTuple):
    """The rope on q and k, where it starts and ends, and the q/k norms right after it."""

    starts: dict[str, Node | None]  # role -> the rope's input on its path (None: no rope)
    fact: RopeFact | None  # None: no rope
    norm_after: dict[str, str] | None  # role -> the norm right after the rope (hunyuan)
    ends: dict[str, Node]  # q/k -> where the proven rope ends (empty without a rope)
    table: RopeTable | None = None  # the source's module whose table gives a computed base
    # k or v -> (the product, the number, its source expression): a config number times it
    scales: dict[str, tuple[Node, float, str]] | None = None


def _rope(
    traced: Traced,
    path: str,
    scope: set[Node],
    args: dict,
    feeders: dict,
    config,
    head_dim: int,
    layer: tuple[str | None, int | None],
) -> _Rope:
    """The rope on exactly q and k, proven by replay; only layout, casts and norms before it;
    ``layer``: the traced layer's (entry of ``config.layer_types``, index)."""
    layer_type, layer_idx = layer
    rope_in = {role: rope_start(arg, feeders[role], scope) for role, arg in args.items()}
    if rope_in["v"] is None and rope_in["q"] is not None and rope_in["k"] is None:
        refuse(
            "vllm_attention",
            "a position-dependent op is applied to q alone, and not as a per-token factor of the "
            "positions the layer is given (which the file could compute from vLLM's positions)",
        )
    if rope_in["v"] is not None or (rope_in["q"] is None) != (rope_in["k"] is None):
        refuse(
            "vllm_attention",
            "a position-dependent op is not applied to exactly q and k",
        )
    stops = {role: rope_in[role] if rope_in[role] is not None else args[role] for role in "qkv"}
    scales = path_scales(traced, path, scope, stops, feeders)
    products = {product for product, _, _ in scales.values()}
    for role, stop in stops.items():  # projection -> rope (or attention): layout, casts, norms only
        nodes = [*path_nodes(stop, feeders[role], scope), stop]
        only_layout([n for n in nodes if n not in products], traced, f"the {role} path", path)
    rope, norm_after = None, None
    if rope_in["q"] is not None:
        rope = prove_rope([(rope_in[r], args[r]) for r in "qk"], config, head_dim, layer_type, layer_idx)
        after_norm = {r: norm_through_layout(args[r], traced) for r in "qk"}
        if isinstance(rope, str) and all(after_norm.values()):
            # q/k norms right after the rope (hunyuan; Llama-4 then transposes): the rope
            # ends at their inputs
            after = prove_rope(
                [(rope_in[r], after_norm[r].args[0]) for r in "qk"],
                config,
                head_dim,
                layer_type,
                layer_idx,
            )
            if not isinstance(after, str):
                rope, norm_after = (
                    after,
                    {r: relative(after_norm[r].target, path) for r in "qk"},
                )
        if isinstance(rope, str):
            refuse_rope(rope)
    rope_ends = {r: after_norm[r].args[0] if norm_after is not None else args[r] for r in "qk"}
    table = _rope_table(traced, path, rope, value(args["q"]).shape[-2], config, layer_type)
    return _Rope(rope_in, rope, norm_after, rope_ends if rope else {}, table, scales)


def _rope_table(traced: Traced, path: str, rope, seq: int, config, layer_type) -> RopeTable | None:
    """The source's rotary module whose table the file reads a computed base off, where the
    replay proved a base no config field holds; else None."""
    if rope is None or rope.source_base is None:
        return None
    length = getattr(config, _max_position_field(config), None)
    table = (
        prove_rope_table(traced, path, rope.source_base, rope.rotary_dim, seq, length)
        if isinstance(length, int)
        else f"no config field holds the longest position ({_max_position_field(config)})"
    )
    if isinstance(table, str):
        refuse_rope(f"{computed_base_reason(rope.source_base, config, layer_type)} ({table})")
    return table


def _norms(
    traced: Traced, path: str, scope: set[Node], args: dict, feeders: dict, rope: _Rope
) -> dict[str, str | None]:
    """Role -> the attribute of its one norm (before the rope, or right after it), or None;
    norms on both q and k or on neither, never on v."""
    ends = {**args, **rope.ends} if rope.norm_after is not None else args  # before the norm
    norms = {
        role: _head_norm(traced, path, scope, ends[role], feeders[role], rope.starts[role], role)
        for role in "qkv"
    }
    if rope.norm_after is not None:
        if norms["q"] is not None or norms["k"] is not None:
            refuse("vllm_attention", "q/k norms both before and after the rotary embedding")
        norms.update(rope.norm_after)
    if norms["v"] is not None:
        refuse("vllm_attention", f"a norm ({norms['v']}) on the v path")
    if (norms["q"] is None) != (norms["k"] is None):
        refuse("vllm_attention", "a norm on only one of the q and k paths")
    return norms


def _qk_norm_over(traced: Traced, path: str, norms: dict, heads: Heads) -> str | None:
    """What the q/k norms normalise over: "head" (every head alike), "each_head" (each with
    weights of its own), "all_heads", or None without norms."""
    if norms["q"] is None:
        return None
    # the width each norm normalises over: its input's last dim (weightless norms too)
    widths = {
        value(n.args[0]).shape[-1]
        for n in traced.graph.nodes
        if n.op == "call_module" and n.target in {f"{path}.{norms[r]}" for r in "qk"}
    }
    if widths == {heads.head_dim}:
        modules = {r: traced.module.get_submodule(f"{path}.{norms[r]}" if path else norms[r]) for r in "qk"}
        counts = {"q": (heads.num_heads, heads.head_dim), "k": (heads.num_kv_heads, heads.head_dim)}
        return "each_head" if own_weights_per_head(modules, counts) else "head"
    if widths <= {heads.num_heads * heads.head_dim, heads.num_kv_heads * heads.head_dim}:
        return "all_heads"
    reason = f"q/k norm widths {sorted(widths)} are neither head_dim nor all heads"
    refuse("vllm_attention", reason)


def _prove_head_layouts(
    traced: Traced,
    path: str,
    args: dict,
    feeders: dict,
    rope: _Rope,
    norms: dict,
    heads: Heads,
    qk_norm_over: str | None,
) -> None:
    """Each of q, k and v splits into heads the way vLLM assumes (prove_head_layout)."""
    counts = {"q": heads.num_heads, "k": heads.num_kv_heads, "v": heads.num_kv_heads}
    for role in "qkv":
        before_rope = None if rope.norm_after is not None else norms[role]
        prove_head_layout(
            traced,
            path,
            feeders[role],
            rope.starts[role] or args[role],
            counts[role],
            heads.v_head_dim if role == "v" else heads.head_dim,
            before_rope,
            qk_norm_over,
            role,
            packed=heads.packed and role == "q",
            scale=rope.scales[role][1] if role in rope.scales else 1.0,
        )


# Config fields of the longest sequence, in the order vLLM reads them for max_model_len
_MAX_POSITION_FIELDS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
    "model_max_length",
    "training_seqlen",
    "max_context_length",  # OpenELM's
)


def _max_position_field(config) -> str:
    return next((f for f in _MAX_POSITION_FIELDS if getattr(config, f, None)), "max_position_embeddings")


def _qkv_group(traced: Traced, path: str) -> list[Node]:
    """The one group of three or more Linears reading the same input, each called once."""
    linears = traced.linears_in(path)
    names = [relative(n.target, path) for n in linears]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        refuse("fuse_qkv", f"{', '.join(repeated)} called more than once")
    groups: dict[Node, list[Node]] = {}  # insertion (graph) order
    for n in linears:
        groups.setdefault(n.args[0], []).append(n)
    # (a fourth linear on the same input is the output gate's: AFMoE, Laguna)
    triples = [g for g in groups.values() if len(g) >= 3]
    if len(triples) != 1:
        refuse(
            "fuse_qkv",
            f"{_count(len(triples))} group of three linears reading the same input",
        )
    return triples[0]


def _attention_call(traced: Traced, path: str) -> Node:
    calls = [n for n in traced.nodes_in(path) if is_attention_leaf(n)]
    if not calls:
        refuse("vllm_attention", no_attention_reason(traced.nodes_in(path), traced))
    if len(calls) != 1:
        refuse(
            "vllm_attention",
            f"{_count(len(calls))} call through the attention interface",
        )
    if not all(isinstance(a, Node) for a in calls[0].args[1:4]):
        refuse("vllm_attention", "q, k or v of the attention call is a constant")
    return calls[0]


def _feeder(traced: Traced, path: str, scope: set[Node], arg: Node, group: list[Node], role: str) -> Node:
    """The Linear of the q/k/v group that the attention's ``role`` input comes from."""
    found = linears_feeding(arg, scope, traced)
    if len(found) != 1 or found[0] not in group:
        names = ", ".join(relative(n.target, path) for n in group)
        refuse(
            "fuse_qkv",
            f"the attention's {role} input does not come from exactly one of {names}",
        )
    return found[0]


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
    # (the attention's input itself where no rope follows the norm: exaone4's NoPE layers)
    norms = [
        n
        for n in (*path_nodes(arg, source, scope), *([arg] if rope_in is None else []))
        if n.op == "call_module" and is_head_norm(traced.submodule(n))
    ]
    if len(norms) > 1:
        refuse("vllm_attention", f"{len(norms)} norms on the {role} path")
    if norms and rope_in is not None and norms[0] not in ancestors(rope_in, scope):
        refuse("vllm_attention", f"the {role} norm is applied after the rotary embedding")
    return relative(norms[0].target, path) if norms else None


def _output_projection(
    traced: Traced, path: str, scope: set[Node], call: Node
) -> tuple[Node, bool, tuple[str, ...]]:
    """The one Linear that consumes the attention output and ends the block, whether the
    block adds a tensor it was given to that Linear's output (BLOOM's ``dropout_add(out,
    residual)``: the residual add inside the attention), and the parameters of its own it
    returns beside (GPT-NeoX-Japanese's ``dense_bias``, added by its layer). Outputs the
    layer's hidden states never read (attention weights returned beside) do not count."""
    consumers = linears_fed_by(call, scope, traced)
    if len(consumers) != 1:
        refuse(
            "vllm_attention",
            f"{_count(len(consumers))} linear consumes the attention output",
        )
    end = past_identity_dropouts(consumers[0], traced, path)
    outputs = read_outputs(traced, path)
    own = [o for o in outputs if _own_parameter(o, traced, path)]
    returned = tuple(relative(o.target, path) for o in own)
    outputs = [o for o in outputs if o not in own]
    if outputs == [end]:
        return consumers[0], False, returned
    if len(outputs) == 1 and adds_given_tensor(outputs[0], end, traced, path) and not returned:
        return consumers[0], True, ()
    refuse("vllm_attention", "the output projection does not end the block")


def _own_parameter(node: Node, traced: Traced, path: str) -> bool:
    """``node`` reads a parameter the attention module at ``path`` holds itself."""
    if node.op != "get_attr" or not path or not node.target.startswith(f"{path}."):
        return False
    name = relative(node.target, path)
    return "." not in name and name in dict(traced.module.get_submodule(path).named_parameters(recurse=False))


def _output_path(
    traced: Traced, path: str, scope: set[Node], call: Node, o_node: Node, proj: _Projections, heads: Heads
) -> tuple[OutputGate | None, str | None]:
    """The output gate between the attention and its projection, or None, and the norm of the
    whole output there (analyze/output_norm.py), or None; the rest of that path layout alone,
    and without either, the projection reading the heads as vLLM lays them."""
    qkv_linears = list({n: None for f in proj.feeders.values() for n in linears_feeding(f, scope, traced)})
    packed_q = proj.feeders["q"] if heads.packed else None
    gate, on_output = output_gate(
        traced, path, scope, call, o_node, qkv_linears, (heads.num_heads, heads.head_dim), packed_q
    )
    if heads.packed and (gate is None or not gate.packed):
        refuse(
            "fuse_qkv",
            f"{proj.q.attr} projects 2 x {heads.num_heads} heads x {heads.head_dim}, its attention reading "
            "half: the other half is no output gate the replay proves",
        )
    only_layout(on_output, traced, "the attention output", path)
    norm = output_norm(traced, path, call, o_node, on_output)
    if gate is not None and norm is not None:
        refuse("vllm_attention", "the attention output is both gated and normalised before its projection")
    if gate is None and norm is None:
        prove_output_layout(call, o_node)
    return gate, norm


def _count(n: int) -> str:
    return "no" if n == 0 else f"{n} instead of one"
