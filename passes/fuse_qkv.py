"""Fuse the q/k/v projections into one ``QKVParallelLinear``.

Matches, in the attention class ``__init__``::

    self.q_proj = nn.Linear(H, NQ * self.head_dim, bias=B)
    self.k_proj = nn.Linear(H, NKV * self.head_dim, bias=B)
    self.v_proj = nn.Linear(H, NKV * self.head_dim, bias=B)

and in ``forward`` the single call of each on the same input ``x``.

Emits the tensor-parallel head bookkeeping of vLLM's ``llama.py`` plus::

    self.qkv_proj = QKVParallelLinear(hidden_size=H, head_size=self.head_dim,
        total_num_heads=NQ, total_num_kv_heads=NKV, bias=B, ...)

and, in ``forward``, ``qkv, _ = self.qkv_proj(x)`` / ``q, k, v = qkv.split(...)`` with the
three calls replaced by ``q``, ``k``, ``v``.

Where the analysis proved v's heads narrower than q's and k's (``AttentionPlan.v_head_dim``:
MiMo-V2-Flash's ``NKV * config.v_head_dim``), v keeps the source's own size expression:
``v_head_size=self.v_head_size`` and a split of ``[q_size, kv_size, v_size]``.

A checkpoint-fused projection may pass through elementwise ops before its split (dbrx:
``qkv = qkv.clamp(...)``): those statements are kept, on ``qkv``.

Preconditions (else the conversion is refused with the reason): the plan found exactly one
q/k/v group on one input (fx); in the source the three share the input and bias expressions,
k and v share the head-count expression, each out size is ``heads * head_dim`` (or, where the
source computed the sizes beforehand, the analysis proved which config fields hold the head
counts: the head size is then the q size over that count), and each projection is called
exactly once in ``forward`` on the same argument.
"""

from __future__ import annotations

from typing import NamedTuple

import libcst as cst
import libcst.matchers as m

from hfrewrite.analyze.plan import MlaPlan
from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.fused_projection import HEAD_SHARDING, after_head_sharding, free_qkv_names, rewrite_fused
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites
from hfrewrite.emit.shared_matchers import builds, nn_call, same
from hfrewrite.errors import HfrewriteError

NAME = "fuse_qkv"


def _linear_parts(stmt: cst.BaseStatement, cls: str, attr: str):
    call = t.assigned_value(stmt)
    if not builds(call, nn_call("Linear")):
        raise HfrewriteError(f"{cls}: {NAME}: self.{attr} is not built with nn.Linear")
    size_in, size_out, bias = t.linear_args(call)
    if not (isinstance(size_out, cst.BinaryOperation) and isinstance(size_out.operator, cst.Multiply)):
        return size_in, None, size_out, bias  # a size computed elsewhere (ERNIE-4.5's q_hidden_size)
    return size_in, size_out.left, size_out.right, bias


def _heads_from_config(init: cst.FunctionDef, parts: dict, roles: tuple, counts, cls: str) -> dict:
    """``parts`` where the out sizes are not spelled ``heads * head_dim``: the head counts are
    the expressions the analysis proved hold them (config fields, or ``__init__``'s own
    parameters where it takes no config: XGLM), and the head size the q projection's own size
    expression divided by the head count."""
    (q, k, v), (heads, kv_heads) = roles, counts
    params = {p.name.value for p in init.params.params} | {"None", "True", "False"}
    if not (heads and kv_heads and t.plain_names(t.expr(f"({heads}, {kv_heads})")) <= params):
        raise HfrewriteError(
            f"{cls}: {NAME}: self.{q} out size is not `heads * head_dim`, and no config field "
            "of __init__ was proven to hold the head counts"
        )
    head_dim = cst.Name("head_size")  # bound by rewrite_attention from the q size
    return {
        attr: (parts[attr][0], t.expr(count), head_dim, parts[attr][3])
        for attr, count in ((q, heads), (k, kv_heads), (v, kv_heads))
    }


class _ReplaceCalls(cst.CSTTransformer):
    """self.q_proj(x) -> q (and k, v); records the argument text and call counts."""

    def __init__(self, names: dict[str, str]) -> None:
        self.names = names
        self.args: dict[str, list[str]] = {a: [] for a in names}
        self.in_order: list[str] = []  # the arguments, in the order of the calls

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        is_self = m.matches(updated.func, m.Attribute(value=m.Name("self")))
        attr = updated.func.attr.value if is_self else ""
        if is_self and attr in self.names:
            self.args[attr].append(",".join(t.code(a) for a in updated.args))
            self.in_order.append(self.args[attr][-1])
            return cst.Name(self.names[attr])
        return updated


class _QkvSizes(NamedTuple):
    """What the fused projection is built from: the source's own size expressions."""

    size_in: cst.BaseExpression | None
    heads: cst.BaseExpression
    kv_heads: cst.BaseExpression
    head_dim: cst.BaseExpression
    bias: cst.BaseExpression | None
    head_size: str  # `head_size = ...` where the head size is derived, else ""
    v_head_dim: cst.BaseExpression | None = None  # v's head size, where narrower (proven)


def _without_packing(parts: tuple, name: str, q: str) -> tuple:
    """The q projection's parts without the ``* 2`` of the tensor packed beside each head."""
    size_in, heads, factor, bias = parts
    if not (m.matches(factor, m.Integer("2")) and isinstance(heads, cst.BinaryOperation)):
        raise HfrewriteError(f"{name}: {NAME}: self.{q} out size is not `heads * head_dim * 2`")
    if not isinstance(heads.operator, cst.Multiply):
        raise HfrewriteError(f"{name}: {NAME}: self.{q} out size is not `heads * head_dim * 2`")
    return size_in, heads.left, heads.right, bias


def _qkv_sizes(
    init: cst.FunctionDef,
    body: list,
    where: dict,
    roles: tuple[str, str, str],
    counts,
    name: str,
    packed: bool = False,
    narrow_v: bool = False,
) -> _QkvSizes:
    """The shared sizes of the three projections; refuses where they differ (``packed``: q's
    projection holds a second tensor per head, ``heads * head_dim * 2``; ``narrow_v``: the
    analysis proved v's heads narrower, v's own size kept)."""
    q, k, v = roles
    parts = {a: _linear_parts(body[where[a]], name, a) for a in roles}
    if packed:
        parts[q] = _without_packing(parts[q], name, q)
    head_size = ""  # the head size as the q projection's size over the proven head count
    if k == v or any(part[1] is None for part in parts.values()):
        if "head_size" in t.names_used(init):
            raise HfrewriteError(f"{name}: {NAME}: __init__ already uses the name head_size")
        q_size = t.code(parts[q][2])
        parts = _heads_from_config(init, parts, roles, counts, name)
        head_size = f"head_size = ({q_size}) // {t.code(parts[q][1])}\n"
    (
        (q_in, q_heads, head_dim, q_bias),
        (k_in, k_heads, k_dim, k_bias),
        (v_in, v_heads, v_dim, v_bias),
    ) = (parts[q], parts[k], parts[v])
    if not same(q_in, k_in, v_in):
        raise HfrewriteError(f"{name}: {NAME}: q/k/v read different input sizes")
    if not same(q_bias, k_bias, v_bias):
        raise HfrewriteError(f"{name}: {NAME}: q/k/v differ in their bias setting")
    if not same(k_heads, v_heads):
        raise HfrewriteError(f"{name}: {NAME}: k_proj and v_proj differ in out_features")
    if not same(head_dim, k_dim, *(() if narrow_v else (v_dim,))):  # one head_size (and v's own)
        raise HfrewriteError(
            f"{name}: {NAME}: q/k/v differ in head_dim ({t.code(head_dim)}, {t.code(k_dim)}, {t.code(v_dim)})"
        )
    return _QkvSizes(q_in, q_heads, k_heads, head_dim, q_bias, head_size, v_dim if narrow_v else None)


_PACKED_HEADS = """\
# q's projection holds each head's q and output gate side by side: twice the heads,
# so that each rank's shard keeps whole heads with their gates.
"""


def _fused_init(
    init: cst.FunctionDef,
    body: list,
    where: dict,
    roles: tuple[str, str, str],
    sizes: _QkvSizes,
    packed: bool = False,
) -> cst.FunctionDef:
    """``__init__`` with the three projections replaced, where the first stood, by the
    head bookkeeping and one ``QKVParallelLinear`` (``packed``: q's part twice the heads)."""
    bias = t.code(sizes.bias) if sizes.bias is not None else "True"
    head_dim = t.code(sizes.head_dim)
    # vLLM's attention reads the head size as self.head_dim: bound from the source's own
    # expression where the source keeps it under another name (self.d)
    assigned = {t.self_attr_assigned(s) for s in t.walk(init.body) if isinstance(s, cst.SimpleStatementLine)}
    head_dim_attr = "" if "head_dim" in assigned else f"self.head_dim = {head_dim}\n"
    fused = t.stmts(
        "tp_size = get_tensor_model_parallel_world_size()\n"
        f"{sizes.head_size}"
        f"self.total_num_heads = {t.code(sizes.heads)}\n"
        f"self.total_num_kv_heads = {t.code(sizes.kv_heads)}\n"
        f"{HEAD_SHARDING}"
        f"{head_dim_attr}"
        f"self.q_size = self.num_heads * {head_dim}\n"
        f"self.kv_size = self.num_kv_heads * {head_dim}\n"
        f"{_narrow_v(sizes)}"
        f"{_PACKED_HEADS if packed else ''}"
        "self.qkv_proj = QKVParallelLinear(\n"
        f"    hidden_size={t.code(sizes.size_in)},\n"
        f"    head_size={head_dim},\n"
        f"    total_num_heads=self.total_num_heads{' * 2' if packed else ''},\n"
        "    total_num_kv_heads=self.total_num_kv_heads,\n"
        f"    bias={bias},\n"
        f"{'    v_head_size=self.v_head_size,' + chr(10) if sizes.v_head_dim is not None else ''}"
        "    quant_config=quant_config,\n"
        '    prefix=f"{prefix}.qkv_proj",\n'
        ")\n"
    )
    replaced = [where[a] for a in roles]
    first = min(replaced)
    fused[0] = fused[0].with_changes(leading_lines=body[first].leading_lines)
    before = [s for i, s in enumerate(body[:first]) if i not in replaced]
    after = [s for i, s in enumerate(body) if i > first and i not in replaced]
    return t.with_body(init, [*before, *fused, *after_head_sharding(after)])


def _narrow_v(sizes: _QkvSizes) -> str:
    """v's head size and width, where its heads are narrower than q's and k's."""
    if sizes.v_head_dim is None:
        return ""
    return (
        f"self.v_head_size = {t.code(sizes.v_head_dim)}\nself.v_size = self.num_kv_heads * self.v_head_size\n"
    )


def _split_forward(
    forward: cst.FunctionDef,
    roles: tuple[str, str, str],
    name: str,
    packed: bool = False,
    narrow_v: bool = False,
) -> cst.FunctionDef:
    """``forward`` with the three calls replaced by ``q``, ``k``, ``v``, bound by the fused
    call and its split just before the first of them (``packed``: q twice its size)."""
    q, k, v = roles
    replacer = _ReplaceCalls({q: "q", k: "k", v: "v"})
    forward = free_qkv_names(forward, name)
    fwd_body = list(forward.body.body)
    first_use = None
    for i, s in enumerate(fwd_body):
        before = sum(map(len, replacer.args.values()))
        fwd_body[i] = s.visit(replacer)
        if first_use is None and sum(map(len, replacer.args.values())) > before:
            first_use = i
    calls = replacer.args
    # (one input: the analysis proved the three read one value; the source may spell it
    # otherwise for k and v, BioGPT's `current_states`, the self-attention branch of a
    # conditional: the first call's spelling is the fused call's)
    if any(len(c) != 1 for c in calls.values()):
        raise HfrewriteError(f"{name}: {NAME}: q/k/v are not each called once")
    first = replacer.in_order[0]
    split = t.stmts(
        f"qkv, _ = self.qkv_proj({first})\n"
        f"q, k, v = qkv.split([{'2 * ' if packed else ''}self.q_size, self.kv_size, "
        f"self.{'v_size' if narrow_v else 'kv_size'}], dim=-1)\n"
    )
    fwd_body[first_use:first_use] = split
    return t.with_body(forward, fwd_body)


def rewrite_attention(
    cls: cst.ClassDef,
    q: str,
    k: str,
    v: str,
    counts: tuple[str | None, str | None] = (None, None),
    packed: bool = False,
    narrow_v: bool = False,
) -> cst.ClassDef:
    """``counts``: the expressions proven to hold the head and kv-head counts; ``k`` may be
    ``v`` (one Linear holding both, TeleChat's key_value): its size is theirs together, so
    the head counts come from those expressions; ``packed``: q's projection holds each head's
    output gate beside it (the analysis proved it), loaded and split whole."""
    name = cls.name.value
    init, body, where = t.init_assignments(cls, (q, k, v), NAME)
    forward = t.find_method(cls, "forward")
    sizes = _qkv_sizes(init, body, where, (q, k, v), counts, name, packed, narrow_v)
    init = _fused_init(init, body, where, (q, k, v), sizes, packed)
    forward = _split_forward(forward, (q, k, v), name, packed, narrow_v)
    return t.set_method(t.set_method(cls, init), forward)


def _head_counts(att) -> tuple[str, str]:
    """The fused projection's head counts: the config fields holding them, else the source's
    own config expressions (which load_weights' reordering helpers cannot use)."""
    fields = att.heads_field is not None and att.kv_heads_field is not None
    heads = f"config.{att.heads_field}" if att.heads_field else att.heads_expr
    kv_heads = f"config.{att.kv_heads_field}" if att.kv_heads_field else att.kv_heads_expr
    if heads is None or kv_heads is None or (att.qkv_layout.load_helper and not fields):
        raise HfrewriteError(f"{att.module_class}: {NAME}: no config fields hold the head counts")
    return heads, kv_heads


def _count_expressions(att) -> tuple[str | None, str | None]:
    """The head and kv-head counts: the source's own expression where the analysis took one
    (no config field holds the count, or ``__init__`` takes no config), else the field."""
    heads, kv_heads = (f"config.{f}" if f else None for f in (att.heads_field, att.kv_heads_field))
    return att.heads_expr or heads, att.kv_heads_expr or kv_heads


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    att = ctx.plan.attention
    if att is None or isinstance(att, MlaPlan):  # attention-free; passes/mla_attention.py
        return PassResult(module=module)
    sites = Sites()
    layout = att.qkv_layout
    if layout is not None and layout.holds_q:
        heads, kv_heads = _head_counts(att)
        cls = rewrite_fused(
            t.find_class(module, att.module_class),
            att.q.attr,
            heads,
            kv_heads,
            layout,
            att.qkv_unpack_lines,
        )
        module = sites.replace_class(module, att.module_class, cls)
        return PassResult(
            module=module,
            imports=("QKVParallelLinear", "get_tensor_model_parallel_world_size"),
            fused=(FusionRow(att.module_class, f"{att.q.attr} ({layout.report}) -> QKVParallelLinear"),),
            matches=sites.count,
        )
    cls = rewrite_attention(
        t.find_class(module, att.module_class),
        att.q.attr,
        att.k.attr,
        att.v.attr,
        _count_expressions(att),
        packed=att.output_gate is not None and att.output_gate.packed,
        narrow_v=att.v_head_dim is not None,
    )
    module = sites.replace_class(module, att.module_class, cls)
    kv_layout = layout.report if layout is not None else ""
    return PassResult(
        module=module,
        imports=("QKVParallelLinear", "get_tensor_model_parallel_world_size"),
        fused=(
            FusionRow(
                att.module_class,
                f"{att.q.attr} + {att.k.attr} ({kv_layout} in the checkpoint, split at load) -> QKVParallelLinear"
                if kv_layout
                else f"{att.q.attr}+{att.k.attr}+{att.v.attr} -> QKVParallelLinear",
            ),
        ),
        matches=sites.count,
    )
