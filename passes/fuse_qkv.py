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

Preconditions (else the conversion is refused with the reason): the plan found exactly one
q/k/v group on one input (fx); in the source the three share the input and bias expressions,
k and v share the head-count expression, each out size is ``heads * head_dim``, and each
projection is called exactly once in ``forward`` on the same argument.
"""

from __future__ import annotations

import libcst as cst

from hfrewrite import cst_tools as t
from hfrewrite.errors import HfrewriteError
from hfrewrite.pass_api import FusionRow, PassContext, PassResult

NAME = "fuse_qkv"


def _linear_parts(stmt: cst.BaseStatement, cls: str, attr: str):
    call = t.assigned_value(stmt)
    if t.call_name(call) != "nn.Linear":
        raise HfrewriteError(f"{cls}: {NAME}: self.{attr} is not built with nn.Linear")
    size_in, size_out = t.arg(call, 0, "in_features"), t.arg(call, 1, "out_features")
    bias = t.arg(call, 2, "bias")
    if not (isinstance(size_out, cst.BinaryOperation) and isinstance(size_out.operator, cst.Multiply)):
        raise HfrewriteError(f"{cls}: {NAME}: self.{attr} out size is not `heads * head_dim`")
    return size_in, size_out.left, size_out.right, bias


class _ReplaceCalls(cst.CSTTransformer):
    """self.q_proj(x) -> q (and k, v); records the argument text and call counts."""

    def __init__(self, names: dict[str, str]) -> None:
        self.names = names
        self.args: dict[str, list[str]] = {a: [] for a in names}

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        func = t.dotted(updated.func) or ""
        attr = func.removeprefix("self.")
        if func.startswith("self.") and attr in self.names:
            self.args[attr].append(",".join(t.code(a) for a in updated.args))
            return cst.Name(self.names[attr])
        return updated


def rewrite_attention(cls: cst.ClassDef, q: str, k: str, v: str) -> cst.ClassDef:
    name = cls.name.value
    init, body, where = t.init_assignments(cls, (q, k, v), NAME)
    forward = t.find_method(cls, "forward")
    parts = {a: _linear_parts(body[where[a]], name, a) for a in (q, k, v)}
    (q_in, q_heads, head_dim, q_bias), (k_in, k_heads, k_dim, k_bias), (v_in, v_heads, v_dim, v_bias) = (
        parts[q], parts[k], parts[v])
    same = lambda *nodes: len({t.code(n) if n is not None else "" for n in nodes}) == 1  # noqa: E731
    if not same(q_in, k_in, v_in):
        raise HfrewriteError(f"{name}: {NAME}: q/k/v read different input sizes")
    if not same(q_bias, k_bias, v_bias):
        raise HfrewriteError(f"{name}: {NAME}: q/k/v differ in their bias setting")
    if not same(k_heads, v_heads) or not same(head_dim, k_dim, v_dim):
        raise HfrewriteError(f"{name}: {NAME}: k_proj and v_proj differ in out_features")

    bias = t.code(q_bias) if q_bias is not None else "True"
    fused = t.stmts(
        "tp_size = get_tensor_model_parallel_world_size()\n"
        f"self.total_num_heads = {t.code(q_heads)}\n"
        f"self.total_num_kv_heads = {t.code(k_heads)}\n"
        "# Heads are sharded over tensor-parallel ranks; kv heads are replicated when\n"
        "# there are fewer of them than ranks.\n"
        "self.num_heads = self.total_num_heads // tp_size\n"
        "self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)\n"
        f"self.q_size = self.num_heads * {t.code(head_dim)}\n"
        f"self.kv_size = self.num_kv_heads * {t.code(head_dim)}\n"
        "self.qkv_proj = QKVParallelLinear(\n"
        f"    hidden_size={t.code(q_in)},\n"
        f"    head_size={t.code(head_dim)},\n"
        "    total_num_heads=self.total_num_heads,\n"
        "    total_num_kv_heads=self.total_num_kv_heads,\n"
        f"    bias={bias},\n"
        "    quant_config=quant_config,\n"
        '    prefix=f"{prefix}.qkv_proj",\n'
        ")\n"
    )
    first = min(where[q], where[k], where[v])
    fused[0] = fused[0].with_changes(leading_lines=body[first].leading_lines)
    new_body = []
    for i, s in enumerate(body):
        if i == first:
            new_body.extend(fused)
        elif i not in (where[q], where[k], where[v]):
            new_body.append(s)
    init = t.with_body(init, new_body)

    replacer = _ReplaceCalls({q: "q", k: "k", v: "v"})
    if t.names_used(forward) & {"q", "k", "v", "qkv"}:
        raise HfrewriteError(f"{name}: {NAME}: forward already uses the names q/k/v/qkv")
    fwd_body = list(forward.body.body)
    first_use = None
    for i, s in enumerate(fwd_body):
        before = sum(map(len, replacer.args.values()))
        fwd_body[i] = s.visit(replacer)
        if first_use is None and sum(map(len, replacer.args.values())) > before:
            first_use = i
    calls = replacer.args
    if any(len(c) != 1 for c in calls.values()) or len({c[0] for c in calls.values()}) != 1:
        raise HfrewriteError(f"{name}: {NAME}: q/k/v are not each called once on one input")
    split = t.stmts(
        f"qkv, _ = self.qkv_proj({calls[q][0]})\n"
        "q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)\n"
    )
    fwd_body[first_use:first_use] = split
    forward = t.with_body(forward, fwd_body)
    return t.set_method(t.set_method(cls, init), forward)


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    att = ctx.plan.attention
    cls = rewrite_attention(t.find_class(module, att.module_class), att.q.attr, att.k.attr, att.v.attr)
    return PassResult(
        module=t.replace_class(module, att.module_class, cls),
        imports=("QKVParallelLinear", "get_tensor_model_parallel_world_size"),
        fused=(FusionRow(att.module_class, f"{att.q.attr}+{att.k.attr}+{att.v.attr} -> QKVParallelLinear"),),
        matches=1,
    )
