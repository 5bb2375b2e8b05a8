"""Multi-head latent attention facts (deepseek_v2/v3), proven by structure and replay.

Pattern (data flow into the attention leaf, never attribute names)::

    q  = q_b(q_a_norm(q_a(x)))            or  q = q(x)            -> [b, H, s, nope + rope]
    kv_c, k_pe = split(kv_a(x))            kv_c -> kv_a_norm -> kv_b -> [b, H, s, nope + v]
    attention([q_nope, rope(q_pe)], [k_nope, rope(k_pe) (one head, shared)], v, scaling)
    out = o(attention output)

Roles: ``kv_b`` is the one linear the attention's v comes from, ``kv_a`` the one it reads,
through exactly one norm; the q projection is the one linear q comes from that v does not;
a norm and a linear before it make the low-rank query. The sizes come from the values
(q and v shapes, the linears' features). The proof is a replay: vLLM's MLA computation (the
module's own linears and norms, vLLM's rope in neox or GPT-J style, causal softmax
attention at the traced scaling) must reproduce the traced output. Each size the emitted
file needs is found by value among the attention module's attributes: exactly one must
hold it (the shrunken config makes the sizes distinct).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.fx import Node

from hfrewrite.analyze.attention import _attention_call, _output_projection
from hfrewrite.analyze.attention_options import HARMLESS_KWARGS
from hfrewrite.analyze.branches import config_branches, helper_branches
from hfrewrite.analyze.dataflow import linears_feeding
from hfrewrite.analyze.leaf_modules import is_norm
from hfrewrite.analyze.mla_cache import MlaCache, mla_cache
from hfrewrite.analyze.plan import MlaPlan, NoMatch, Refusal, refuse
from hfrewrite.analyze.rope import _inv_freq, apply_rope, deepseek_yarn, rope_parameters
from hfrewrite.analyze.rope_styles import RopeStyle
from hfrewrite.analyze.trace import Traced, causal_sdpa, relative, scope_below, value

PATTERN = "mla_attention"
# The rope types get_rope(config.rope_parameters) computes as transformers does (MiniCPM3's
# released checkpoints use LongRoPE)
STATIC_ROPES = ("default", "linear", "llama3", "longrope")
ATOL = 1e-4


def is_mla(traced: Traced, path: str) -> bool:
    """The attention's v comes from one projection that k also comes from and q does not,
    and that reads another projection (the expansion of a shared latent): the shape this
    analysis handles. A fused k/v projection of the hidden states (TeleChat) is not MLA."""
    try:
        call = _attention_call(traced, path)
    except Refusal:
        return False
    scope = set(traced.nodes_in(path))
    q, k, v = (linears_feeding(arg, scope, traced) for arg in call.args[1:4])
    return len(v) == 1 and v[0] in k and v[0] not in q and bool(linears_feeding(v[0].args[0], scope, traced))


def analyze_mla(traced: Traced, path: str, config, layer_type: str | None = None) -> MlaPlan | NoMatch:
    cls = type(traced.module.get_submodule(path)).__name__
    try:
        return _analyze(traced, path, cls, config, layer_type)
    except Refusal as refusal:  # the attention's own checks (attention.py) refuse as MLA here
        return NoMatch(PATTERN, cls, refusal.no_match.reason)


def _scale_attr(attention: nn.Module, scaling: float, cls: str) -> str:
    """The one float attribute of hand-written attention equal to its proven scale."""
    holders = [a for a, v in vars(attention).items() if type(v) is float and v == scaling and a[0] != "_"]
    if len(holders) != 1:
        refuse(PATTERN, f"{len(holders)} float attributes of {cls} hold its attention scale ({scaling:.6g})")
    return holders[0]


def _one(nodes: list[Node], what: str) -> Node:
    if len(nodes) != 1:
        refuse(PATTERN, f"{len(nodes)} {what}, expected one")
    return nodes[0]


def _norm_between(traced: Traced, scope: set[Node], start: Node, end: Node, what: str) -> Node:
    """The one norm module on the data flow from ``start`` to ``end``."""
    between, todo, seen = [], [end], {end}
    while todo:
        for arg in todo.pop().all_input_nodes:
            if arg in scope and arg not in seen and arg is not start:
                seen.add(arg)
                todo.append(arg)
                if arg.op == "call_module" and is_norm(traced.submodule(arg)):
                    between.append(arg)
    return _one(between, f"norms between {what}")


class _Roles(NamedTuple):
    """The projections and norms of the latent attention, by role (``q_a`` and ``q_a_norm``
    None without a low-rank query)."""

    q_a: Node | None
    q_a_norm: Node | None
    q_b: Node
    kv_a: Node
    kv_a_norm: Node
    kv_b: Node
    o: Node


class _Sizes(NamedTuple):
    """The sizes of the latent attention, from the q and v values and the linears' features."""

    heads: int
    qk_head: int  # nope + rope
    v_head: int
    kv_lora: int
    rope: int
    nope: int


class _Rope(NamedTuple):
    """The rope vLLM computes for the config: its kind and frequencies."""

    kind: str  # "default" or "deepseek_yarn"
    freq: tuple
    legacy: bool  # a transformers 4.x config: a scaled rope's parameters in rope_scaling


def _analyze(traced: Traced, path: str, cls: str, config, layer_type: str | None) -> MlaPlan:
    scope = set(traced.nodes_in(path))
    call = _attention_call(traced, path)
    q_arg, k_arg, v_arg = call.args[1:4]
    roles = _roles(traced, path, scope, call)
    linears = [roles.q_a, roles.q_b, roles.kv_a, roles.kv_b, roles.o]
    mods = {n: traced.submodule(n) for n in linears if n is not None}
    _refuse_unsupported(call, mods)
    sizes = _sizes(value(q_arg), value(v_arg), mods, roles)
    scaling = value(call.kwargs.get("scaling"))
    scaling = float(sizes.qk_head**-0.5 if scaling is None else scaling)
    rope = _rope(config, layer_type, sizes.rope)
    style = _replay(traced, roles, sizes, rope, scaling, value(q_arg), value(k_arg))
    attention = traced.module.get_submodule(path)
    dims = _dims(attention, sizes, roles, mods, cls)
    kv_cache = mla_cache(getattr(config, "model_type", None))
    if kv_cache is MlaCache.PER_HEAD and sizes.v_head > sizes.qk_head:
        refuse(
            PATTERN,
            f"vLLM 0.32 gives {config.model_type!r} no latent cache, and its per-head Attention has one "
            f"head size: v heads ({sizes.v_head}) wider than q/k heads ({sizes.qk_head})",
        )
    return MlaPlan(
        module_class=cls,
        q_a=roles.q_a and relative(roles.q_a.target, path),
        q_a_norm=roles.q_a_norm and relative(roles.q_a_norm.target, path),
        q_b=relative(roles.q_b.target, path),
        kv_a=relative(roles.kv_a.target, path),
        kv_a_norm=relative(roles.kv_a_norm.target, path),
        kv_b=relative(roles.kv_b.target, path),
        o=relative(roles.o.target, path),
        num_heads=sizes.heads,
        qk_nope_head_dim=sizes.nope,
        qk_rope_head_dim=sizes.rope,
        v_head_dim=sizes.v_head,
        kv_lora_rank=sizes.kv_lora,
        q_lora_rank=mods[roles.q_a].out_features if roles.q_a is not None else None,
        scaling=scaling,
        scale_attr=_scale_attr(attention, scaling, cls) if call.target is causal_sdpa else None,
        rope_style=style,
        rope_kind=rope.kind,
        rope_kinds=(rope.kind,),
        rope_source="rope_scaling" if rope.legacy else "rope_parameters",
        kv_cache=kv_cache,
        dims=dims,
        config_branches=config_branches(attention),
        init_branches=helper_branches(attention),
        none_attrs=tuple(
            sorted(a for a, v in vars(attention).items() if v is None and not a.startswith("_"))
        ),
    )


def _roles(traced: Traced, path: str, scope: set[Node], call: Node) -> _Roles:
    """The roles by data flow into the attention call, never by attribute name; refuses
    other linears in the block and a residual added to its output."""
    q_arg, k_arg, v_arg = call.args[1:4]
    kv_b = _one(linears_feeding(v_arg, scope, traced), "linears the attention's v comes from")
    kv_a = _one(linears_feeding(kv_b.args[0], scope, traced), "linears the kv expansion reads")
    # (the shared rope key may be written into k in place: the replay proves its use)
    if not {kv_b} <= set(linears_feeding(k_arg, scope, traced)) <= {kv_a, kv_b}:
        refuse(PATTERN, "k does not come from the latent kv projection and its expansion")
    kv_a_norm = _norm_between(traced, scope, kv_a, kv_b, "the latent kv projection and its expansion")
    q_b = _one(
        [n for n in linears_feeding(q_arg, scope, traced) if n not in (kv_a, kv_b)],
        "linears the attention's q comes from",
    )
    x = kv_a.args[0]
    q_a = q_a_norm = None
    if q_b.args[0] is not x:  # low-rank query: q_a -> norm -> q_b
        q_a = _one(
            linears_feeding(q_b.args[0], scope, traced),
            "linears the query expansion reads",
        )
        q_a_norm = _norm_between(traced, scope, q_a, q_b, "the query projections")
        if q_a.args[0] is not x:
            refuse(PATTERN, "the query and latent kv projections read different inputs")
    o, adds_residual, returned = _output_projection(traced, path, scope, call)
    if adds_residual:
        refuse(PATTERN, "the block adds a tensor it is given to its output projection")
    if returned:
        refuse(PATTERN, f"the block returns parameters of its own beside its output: {list(returned)}")
    extra = set(traced.linears_in(path)) - {q_a, q_b, kv_a, kv_b, o}
    if extra:
        inside = sorted({scope_below(n, path) for n in extra} - {None, *(n.target for n in extra)})
        holders = ", ".join(
            f"{relative(h, path)} ({type(traced.module.get_submodule(h)).__name__})" for h in inside
        )
        refuse(
            PATTERN,
            f"other linears in the block: {sorted(relative(n.target, path) for n in extra)}"
            + (f", in {holders}" if holders else ""),
        )
    return _Roles(q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o)


def _refuse_unsupported(call: Node, mods: dict[Node, nn.Module]) -> None:
    """Refuses biased projections and attention keywords that change the math."""
    if any(m.bias is not None for m in mods.values()):
        refuse(PATTERN, "a biased projection (vLLM's MLA projections have no bias)")
    for key in sorted(set(call.kwargs) - HARMLESS_KWARGS):
        passed = value(call.kwargs[key])
        if passed is not None and passed is not False:
            refuse(PATTERN, f"the attention call passes {key}")
    if (
        value(call.kwargs.get("dropout", 0.0))
        or value(call.kwargs.get("softcap"))
        or value(call.kwargs.get("sliding_window"))
    ):
        refuse(PATTERN, "attention dropout, soft cap or sliding window")


def _sizes(qv, vv, mods: dict[Node, nn.Module], roles: _Roles) -> _Sizes:
    """The sizes from the q and v values ``qv``, ``vv``; refused unless the projections fit
    heads x (nope + rope, v) with a shared rope key."""
    if not (torch.is_tensor(qv) and torch.is_tensor(vv) and qv.dim() == 4 and vv.dim() == 4):
        refuse(PATTERN, "q and v are not [batch, heads, seq, head_dim]")
    heads, qk_head, v_head = qv.shape[1], qv.shape[3], vv.shape[3]
    kv_lora = mods[roles.kv_b].in_features
    rope = mods[roles.kv_a].out_features - kv_lora
    nope = qk_head - rope
    if not (
        0 < rope <= qk_head
        and mods[roles.kv_b].out_features == heads * (nope + v_head)
        and mods[roles.q_b].out_features == heads * qk_head
        and mods[roles.o].in_features == heads * v_head
    ):
        refuse(
            PATTERN,
            "projection sizes do not fit heads x (nope + rope, v) with a shared rope key",
        )
    return _Sizes(heads, qk_head, v_head, kv_lora, rope, nope)


def _rope(config, layer_type: str | None, rope: int) -> _Rope:
    """The rope of ``rope`` lanes vLLM computes for the config: YaRN as vLLM's deepseek_yarn,
    or a rope whose table ``get_rope`` builds as transformers does (not the dynamic NTK rope,
    whose table transformers recomputes past ``max_position_embeddings`` and vLLM does not)."""
    params = rope_parameters(config, layer_type)
    legacy = getattr(config, "rope_parameters", None) is None and hasattr(config, "rope_scaling")
    if legacy and config.rope_scaling:  # a transformers 4.x config: the rope type under "type"
        scaled = dict(config.rope_scaling)
        kind = scaled.pop("rope_type", None) or scaled.pop("type", "default")
        params = {**params, **scaled, "rope_type": kind}
    rope_type = params.get("rope_type", "default")
    if rope_type == "yarn":  # vLLM's deepseek_v2.py maps it to its deepseek_yarn rope
        rope_kind, freq = "deepseek_yarn", deepseek_yarn(params, rope)
        if isinstance(freq, str):
            refuse(PATTERN, freq)
    elif rope_type in STATIC_ROPES:  # get_rope builds the table transformers computes
        rope_kind, freq = (
            rope_type,
            _inv_freq(config, params, layer_type, rope) if params else None,
        )
    else:
        refuse(
            PATTERN,
            f"rope_type {rope_type!r}: only YaRN and the static ropes "
            f"({', '.join(STATIC_ROPES)}) are proven for MLA",
        )
    if freq is None:
        refuse(PATTERN, f"no rope frequencies vLLM computes for rotary dim {rope}")
    return _Rope(rope_kind, freq, legacy)


def _replay(
    traced: Traced, roles: _Roles, sizes: _Sizes, rope: _Rope, scaling: float, q_src, k_src
) -> RopeStyle:
    """The rope style in which vLLM's MLA computation reproduces the module's
    output, its q.k scores those of the attention call's ``q_src``, ``k_src``."""
    x = roles.kv_a.args[0]
    fns = {r: traced.submodule(n) for r, n in roles._asdict().items() if n is not None}
    got = value(roles.o)
    for style in RopeStyle:
        qkv = mla_qkv(
            value(x), fns, sizes.heads, sizes.nope, sizes.rope, sizes.v_head, sizes.kv_lora, rope.freq, style
        )
        want = mla_output(*qkv, fns["o"], scaling, value(x).dtype)
        if want.shape == got.shape and torch.allclose(want, got, atol=ATOL, rtol=1e-4):
            break
    else:
        refuse(
            PATTERN,
            "the replay of vLLM's MLA (either rope style) does not reproduce the module",
        )
    if not _same_scores(q_src, k_src, *qkv[:2]):
        refuse(
            PATTERN,
            f"the source's q.k scores are not those of the {rope.kind} rope (replayed before the softmax)",
        )
    return style


def _dims(
    attention: nn.Module, sizes: _Sizes, roles: _Roles, mods: dict[Node, nn.Module], cls: str
) -> tuple[tuple[str, str], ...]:
    """(size, the one attribute of the attention holding it), for each size the emitted
    file reads."""
    wanted = {
        "hidden_size": mods[roles.kv_a].in_features,
        "num_heads": sizes.heads,
        "qk_nope_head_dim": sizes.nope,
        "qk_rope_head_dim": sizes.rope,
        "v_head_dim": sizes.v_head,
        "kv_lora_rank": sizes.kv_lora,
        "qk_head_dim": sizes.qk_head,
    }
    if roles.q_a is not None:
        wanted["q_lora_rank"] = mods[roles.q_a].out_features
    dims = []
    for name, size in wanted.items():
        holders = [
            a for a, v in vars(attention).items() if type(v) is int and v == size and not a.startswith("_")
        ]
        if len(holders) != 1:
            refuse(
                PATTERN,
                f"{len(holders)} attributes of {cls} hold its {name} ({size}), expected one",
            )
        dims.append((name, holders[0]))
    return tuple(dims)


def mla_qkv(
    x: torch.Tensor,
    fns: dict[str, nn.Module],
    heads: int,
    nope: int,
    rope: int,
    v_head: int,
    kv_lora: int,
    freq: tuple,
    style: RopeStyle,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v [batch, heads, seq, dim] (float64) as the emitted file computes them from
    ``x`` [batch, seq, hidden]: vLLM's MLA math with the module's own projections and norms,
    positions 0..seq-1."""
    batch, seq, _ = x.shape
    with torch.no_grad():
        q = fns["q_b"](fns["q_a_norm"](fns["q_a"](x))) if "q_a" in fns else fns["q_b"](x)
        q = q.view(batch, seq, heads, nope + rope).transpose(1, 2)  # [b, H, s, d]
        kv_c, k_pe = fns["kv_a"](x).split([kv_lora, rope], dim=-1)
        kv = fns["kv_b"](fns["kv_a_norm"](kv_c)).view(batch, seq, heads, nope + v_head).transpose(1, 2)
        k_nope, v = kv.split([nope, v_head], dim=-1)
        positions = torch.arange(seq)
        q_pe = apply_rope(q[..., nope:], positions, *freq, style)
        k_pe = apply_rope(k_pe[:, None], positions, *freq, style).expand(batch, heads, seq, rope)
        q = torch.cat([q[..., :nope].double(), q_pe], dim=-1)
        k = torch.cat([k_nope.double(), k_pe], dim=-1)
        return q, k, v.double()


def mla_output(q, k, v, o: nn.Module, scaling: float, dtype) -> torch.Tensor:
    """Causal attention over ``q``, ``k``, ``v`` [batch, heads, seq, dim], through ``o``."""
    batch, _, seq, _ = v.shape
    with torch.no_grad():
        scores = (q @ k.transpose(-1, -2)) * scaling
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, -1)
        return o(out.to(dtype))


def _same_scores(q_src, k_src, q, k) -> bool:
    """The attention call's q.k scores equal the replay's: the rope checked where tiny random
    weights do not wash it out in the softmax (a YaRN table and the default one differ by
    little at the example's few positions). Lane order may differ (a de-interleaved rope)."""
    if not (torch.is_tensor(q_src) and torch.is_tensor(k_src) and q_src.shape == q.shape):
        return False
    k_src = k_src.expand_as(k) if k_src.shape != k.shape else k_src
    got = q_src.double() @ k_src.double().transpose(-1, -2)
    want = q @ k.transpose(-1, -2)
    return torch.allclose(got, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))
