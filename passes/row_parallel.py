"""Turn the projections that produce a block's output into ``RowParallelLinear``.

Matches ``self.<o> = nn.Linear(I, H, bias=B)`` for the attention output projection and the
MLP down projection named in the plan (fx: the linear producing the block's output), and
the projections the MLP's form shards by columns (``MlpForm.column_sharded``): the up
projection of an ungated MLP (``down(act(up(x)))``, act proven elementwise), gate and up of
a gated MLP whose act vLLM has no ``*AndMul`` for (proven to read gate and up lane by lane;
one ``[gate; up]`` Linear becomes ``MergedColumnParallelLinear(I, [2I // 2] * 2)``, so each
rank's output is its gate columns then its up columns, which the source's ``chunk`` splits),
and an attention's output gate (``o(attn * act(gate(x)))``, proven by replay), column-parallel.
An output projection after a norm of the whole attention output takes the gathered heads
(``input_is_parallel=False``: each rank keeps its part of the input), as a down projection
after a norm of the whole intermediate takes the gathered columns (BitNet's ``ffn_sub_norm``,
which forward then calls on ``tensor_model_parallel_all_gather`` of its input).
The Linears of an MLP class kept from the source (no form fits it, proven per token) become
``ReplicatedLinear``: the whole weight on every rank, loaded and quantized as vLLM's linears.

Emits ``RowParallelLinear(I, H, bias=B, quant_config=..., prefix=...)`` (the up projection:
``ColumnParallelLinear``, so each rank holds a slice of the intermediate; the gate: a slice
of the heads, the rank's own); vLLM's parallel
linears return ``(output, bias)``, so ``y = self.o(x)`` becomes ``y, _ = self.o(x)`` and a
call nested in an expression becomes ``self.o(x)[0]``.

Preconditions: the attribute is built with ``nn.Linear`` in ``__init__``.
"""

from __future__ import annotations

import libcst as cst

from hfrewrite.analyze.mlp_forms import MlpForm
from hfrewrite.analyze.plan import MlaPlan
from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult
from hfrewrite.emit.shared_matchers import builds, nn_call
from hfrewrite.errors import HfrewriteError

NAME = "row_parallel"


class _Unpack(cst.CSTTransformer):
    """Assign-level rewrite first (so the call is not subscripted), then nested calls."""

    def __init__(self, attr: str) -> None:
        self.func = f"self.{attr}"

    def leave_Assign(self, original, updated):
        if (
            len(updated.targets) == 1
            and isinstance(updated.targets[0].target, cst.Name)
            and isinstance(updated.value, cst.Subscript)
            and t.call_name(updated.value.value) == self.func
        ):
            target = cst.Tuple(
                [cst.Element(updated.targets[0].target), cst.Element(cst.Name("_"))],
                lpar=[],
                rpar=[],
            )
            return updated.with_changes(targets=[cst.AssignTarget(target)], value=updated.value.value)
        return updated

    def leave_Call(self, original, updated):
        if t.call_name(updated) == self.func:
            return cst.Subscript(updated, [cst.SubscriptElement(cst.Index(cst.Integer("0")))])
        return updated


class _GatheredNormInput(cst.CSTTransformer):
    """``self.<norm>(y)`` -> ``self.<norm>(tensor_model_parallel_all_gather(y))``."""

    def __init__(self, norm: str) -> None:
        self.func, self.count = f"self.{norm}", 0

    def leave_Call(self, original, updated):
        if t.call_name(updated) != self.func or len(updated.args) != 1:
            return updated
        self.count += 1
        gathered = t.expr(f"tensor_model_parallel_all_gather({t.code(updated.args[0].value)})")
        return updated.with_changes(args=[updated.args[0].with_changes(value=gathered)])


def gathered_norm_input(cls: cst.ClassDef, norm: str) -> cst.ClassDef:
    """``cls`` whose forward gives its one call of ``self.<norm>`` every rank's columns."""
    forward = t.find_method(cls, "forward")
    gather = _GatheredNormInput(norm)
    forward = forward.visit(gather)
    if gather.count != 1:
        raise HfrewriteError(f"{cls.name.value}: {NAME}: self.{norm} is not called once in forward")
    return t.set_method(cls, forward)


def _assignment(init: cst.FunctionDef, attr: str) -> int | None:
    """The index of ``init``'s first ``self.<attr> = ...`` statement, if any."""
    return next((i for i, s in enumerate(init.body.body) if t.self_attr_assigned(s) == attr), None)


def _builds_linear(cls: cst.ClassDef, attr: str) -> bool:
    """``__init__`` assigns ``self.<attr> = nn.Linear(...)``."""
    init = t.find_method(cls, "__init__")
    i = _assignment(init, attr)
    return i is not None and builds(t.assigned_value(init.body.body[i]), nn_call("Linear"))


def rewrite(
    cls: cst.ClassDef,
    attr: str,
    kind: str = "RowParallelLinear",
    reduce_param: bool = False,
    whole_input: bool = False,
) -> cst.ClassDef:
    """``reduce_param``: the class takes ``reduce_results: bool = True`` and passes it on
    (a MoE block's shared expert is built with False: vLLM's MoE runner reduces it);
    ``whole_input``: every rank is given the whole input (``input_is_parallel=False``)."""
    name = cls.name.value
    init = t.find_method(cls, "__init__")
    body = list(init.body.body)
    i = _assignment(init, attr)
    if i is None:
        raise HfrewriteError(f"{name}: {NAME}: self.{attr} is not assigned in __init__")
    call = t.assigned_value(body[i])
    if not builds(call, nn_call("Linear")):
        raise HfrewriteError(f"{name}: {NAME}: self.{attr} is not nn.Linear")
    size_in, size_out, bias = t.linear_args(call)
    bias_src = t.code(bias) if bias is not None else "True"
    sizes = t.code(size_out)  # a merged [gate; up] Linear: its two halves
    sizes = f"[{sizes} // 2] * 2" if kind == "MergedColumnParallelLinear" else sizes
    body[i] = t.stmt(
        f"self.{attr} = {kind}(\n    {t.code(size_in)},\n    {sizes},\n"
        f"    bias={bias_src},\n{'    reduce_results=reduce_results,' + chr(10) if reduce_param else ''}"
        f"{'    input_is_parallel=False,' + chr(10) if whole_input else ''}"
        "    quant_config=quant_config,\n"
        f'    prefix=f"{{prefix}}.{attr}",\n)\n'
    ).with_changes(leading_lines=body[i].leading_lines)
    if reduce_param:
        init = t.with_params(init, ["reduce_results: bool = True"])
    cls = t.set_method(cls, t.with_body(init, body))
    return cls.visit(_Unpack(attr))


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    rows = []
    mlp = ctx.plan.mlp
    att = ctx.plan.attention
    targets = (
        []
        if att is None or isinstance(att, MlaPlan)
        else [(att.module_class, att.o.attr, "RowParallelLinear")]
    )
    gate = None if att is None or isinstance(att, MlaPlan) else att.output_gate
    if gate is not None and not gate.packed:  # sharded as the heads are (packed: in qkv_proj)
        targets.append((att.module_class, att.output_gate.attr, "ColumnParallelLinear"))
    # the output projection after a norm of the whole attention output: its input gathered
    gathered = {(att.module_class, att.o.attr)} if targets and att.output_norm else set()
    moe = ctx.plan.moe
    shared = moe is not None and moe.shared_expert is not None
    if mlp is not None:
        targets.append((mlp.module_class, mlp.down.attr, "RowParallelLinear"))
        if mlp.inner_norm:  # the norm inside reads every rank's columns: down takes them all
            gathered.add((mlp.module_class, mlp.down.attr))
            cls = gathered_norm_input(t.find_class(module, mlp.module_class), mlp.inner_norm)
            module = t.replace_class(module, mlp.module_class, cls)
            rows.append(
                FusionRow(
                    mlp.module_class, f"{mlp.inner_norm} kept over every rank's columns (proven per token)"
                )
            )
        # ungated or pairwise: gate and up by columns, the source's act proven per lane
        targets += [(mlp.module_class, attr, kind) for attr, kind in mlp.form.column_sharded(mlp)]
    for kept in [k for k in ctx.plan.kept_mlps if k.linears]:  # the whole weight on every rank
        cls = t.find_class(module, kept.module_class)
        targets += [
            (kept.module_class, a, "ReplicatedLinear") for a in kept.linears if _builds_linear(cls, a)
        ]
    for cls_name, attr, kind in targets:
        reduce_param = shared and cls_name == mlp.module_class and kind == "RowParallelLinear"
        module = t.replace_class(
            module,
            cls_name,
            rewrite(t.find_class(module, cls_name), attr, kind, reduce_param, (cls_name, attr) in gathered),
        )
        pairwise = mlp is not None and mlp.form is MlpForm.PAIRWISE and cls_name == mlp.module_class
        note = f" ({mlp.form.label})" if pairwise and kind != "RowParallelLinear" else ""
        rows.append(FusionRow(cls_name, f"{attr} -> {kind}{note}"))
    return PassResult(
        module=module,
        imports=tuple(sorted({k for *_, k in targets}))
        + (("tensor_model_parallel_all_gather",) if mlp is not None and mlp.inner_norm else ()),
        fused=tuple(rows),
        matches=len(rows),
    )
