"""Fuse the gate/up projections into ``MergedColumnParallelLinear`` + an ``*AndMul`` activation.

Matches the MLP class::

    self.gate_proj = nn.Linear(H, I, bias=B)
    self.up_proj = nn.Linear(H, I, bias=B)
    self.act_fn = ACT2FN[config.hidden_act]
    ...
    self.act_fn(self.gate_proj(x)) * self.up_proj(x)

Emits::

    self.gate_up_proj = MergedColumnParallelLinear(H, [I] * 2, bias=B, ...)
    self.act_fn = get_act_and_mul_fn(config.hidden_act)
    ...
    gate_up, _ = self.gate_up_proj(x)
    ... self.act_fn(gate_up) ...

``get_act_and_mul_fn`` picks vLLM's ``SiluAndMul`` (or ``GeluAndMul``...) from the same config
value the source reads, so the file stays right for every config of the type.

Preconditions (else refused with the reason): the plan found ``mul(act(gate(x)), up(x))`` on
one ``x`` with an activation vLLM has an ``*AndMul`` for; in the source gate and up share
input size and bias expressions, the activation is ``ACT2FN[...]`` (or torch's function
called inline, proven by the plan: it becomes ``self.act_fn``), and the product appears
exactly once, with gate and up called nowhere else.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from hfrewrite.analyze.mlp_forms import MlpForm
from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites
from hfrewrite.emit.shared_matchers import builds, nn_call, same, self_attr
from hfrewrite.emit.taken_init import with_traced_branches
from hfrewrite.errors import HfrewriteError

NAME = "fuse_gate_up"
_ACT_FN = "act_fn"  # vLLM's name for the fused activation, where the source has no attribute


class _FuseProduct(cst.CSTTransformer):
    """act(gate(x)) * up(x) -> act(gate_up); remembers x."""

    def __init__(self, gate: str, up: str, act: str) -> None:
        self.gate, self.up = f"self.{gate}", f"self.{up}"
        self.act = f"self.{act}" if act else None  # None: torch's function, the one the plan proved
        self.out = f"self.{act or _ACT_FN}"
        self.inputs: list[str] = []

    def _proj_input(self, node: cst.BaseExpression, proj: str) -> str | None:
        if t.call_name(node) == proj and len(node.args) == 1:
            return t.code(node.args[0].value)
        return None

    def leave_BinaryOperation(self, original, updated):
        if not isinstance(updated.operator, cst.Multiply):
            return updated
        for act_call, up_call in (
            (updated.left, updated.right),
            (updated.right, updated.left),
        ):
            if not isinstance(act_call, cst.Call) or len(act_call.args) != 1:
                continue
            if self.act is not None and t.call_name(act_call) != self.act:
                continue
            x_gate = self._proj_input(act_call.args[0].value, self.gate)
            x_up = self._proj_input(up_call, self.up)
            if x_gate is not None and x_gate == x_up:
                self.inputs.append(x_gate)
                return t.expr(f"{self.out}(gate_up)")
        return updated


def _traced_branches_built(cls: cst.ClassDef, mlp) -> cst.ClassDef:
    """``cls`` whose ``__init__`` builds its Linears in the branch of each config switch the
    traced config took (OpenELM's ``if config.ffn_with_glu:``), refusing configs that take
    another; switches that only compute sizes stay (LFM2's)."""
    if not mlp.init_switches:
        return cls
    linears = {f.attr for f in (mlp.gate, mlp.up, mlp.down) if f is not None}

    def sizes_only(statement: cst.If) -> bool:
        assigned = {
            t.self_attr_assigned(s) for s in t.walk(statement) if isinstance(s, cst.SimpleStatementLine)
        }
        return not assigned & linears

    return with_traced_branches(cls, mlp.init_switches, t.init_exprs(cls), keep=sizes_only)


def rewrite_mlp(cls: cst.ClassDef, gate: str, up: str, act: str, activation: str) -> cst.ClassDef:
    """``act``: the attribute holding the activation, or "" when forward calls torch's
    ``activation`` function itself (the fused one then lives in ``self.act_fn``)."""
    name = cls.name.value
    init, body, where = t.init_assignments(cls, tuple(a for a in (gate, up, act) if a), NAME)
    forward = t.find_method(cls, "forward")
    act_attr = act or _ACT_FN  # where the fused activation lives
    if not act:
        body = _with_act_fn(name, body, forward, activation)
        where[_ACT_FN] = len(body) - 1
    act_expr = t.assigned_value(body[where[act]]) if act else None
    g, u = (t.assigned_value(body[where[x]]) for x in (gate, up))
    merged = _merged_linear(name, gate, up, g, u).with_changes(leading_lines=body[where[gate]].leading_lines)
    act_key = _act_key(act_expr, activation)
    new_body = []
    for i, s in enumerate(body):
        if i == where[gate]:
            new_body.append(merged)
        elif i == where[act_attr]:
            new_body.append(
                t.stmt(f"self.{act_attr} = get_act_and_mul_fn({act_key})\n").with_changes(
                    leading_lines=s.leading_lines
                )
            )
        elif i != where[up]:
            new_body.append(s)
    init = t.with_body(init, new_body)
    forward = _fused_forward(name, forward, gate, up, act if act_expr is not None else "")
    return t.set_method(t.set_method(cls, init), forward)


def _with_act_fn(
    name: str, body: list[cst.BaseStatement], forward: cst.FunctionDef, activation: str
) -> list[cst.BaseStatement]:
    """``__init__``'s ``body`` with ``self.act_fn`` built for torch's ``activation`` function,
    which forward calls itself."""
    if _ACT_FN in {t.self_attr_assigned(s) for s in body} | t.self_attrs_used(forward):
        raise HfrewriteError(f"{name}: {NAME}: self.{_ACT_FN} already exists")
    return [*body, t.stmt(f'self.{_ACT_FN} = get_act_and_mul_fn("{activation}")\n')]


def _merged_linear(
    name: str, gate: str, up: str, g: cst.BaseExpression, u: cst.BaseExpression
) -> cst.SimpleStatementLine:
    """``self.gate_up_proj = MergedColumnParallelLinear(...)`` for the source's
    ``nn.Linear`` gate and up, which must read the same input size with the same bias."""
    if not builds(g, nn_call("Linear")) or not builds(u, nn_call("Linear")):
        raise HfrewriteError(f"{name}: {NAME}: {gate}/{up} are not nn.Linear")
    g_in, g_out, g_bias = t.linear_args(g)
    u_in, u_out, u_bias = t.linear_args(u)
    if not same(g_in, u_in):
        raise HfrewriteError(f"{name}: {NAME}: {gate} and {up} read different input sizes")
    if not same(g_bias, u_bias):
        raise HfrewriteError(f"{name}: {NAME}: {gate} and {up} differ in their bias setting")
    sizes = f"[{t.code(g_out)}] * 2" if same(g_out, u_out) else f"[{t.code(g_out)}, {t.code(u_out)}]"
    bias = t.code(g_bias) if g_bias is not None else "True"
    return t.stmt(
        "self.gate_up_proj = MergedColumnParallelLinear(\n"
        f"    {t.code(g_in)},\n    {sizes},\n    bias={bias},\n"
        '    quant_config=quant_config,\n    prefix=f"{prefix}.gate_up_proj",\n)\n'
    )


def _act_key(a: cst.BaseExpression | None, activation: str) -> str:
    """``get_act_and_mul_fn``'s argument for the source's activation ``a`` (None: torch's
    function, called in forward)."""
    # ACT2FN[config.hidden_act] keeps its config key; a module built otherwise (``nn.SiLU()``)
    # gets the name of the activation the analysis replayed it as
    from_config = isinstance(a, cst.Subscript) and t.dotted(a.value) == "ACT2FN"
    return t.code(a.slice[0].slice.value) if from_config else f'"{activation}"'


def _fused_forward(name: str, forward: cst.FunctionDef, gate: str, up: str, act: str) -> cst.FunctionDef:
    """``forward`` computing ``gate_up`` right before the one ``act(gate(x)) * up(x)``,
    which becomes the fused activation of it."""
    fuser = _FuseProduct(gate, up, act)
    fwd_body = _inline_projections(list(forward.body.body), {gate, up})
    for i, s in enumerate(fwd_body):
        new = s.visit(fuser)
        if new is not s and fuser.inputs and not new.deep_equals(s):
            fwd_body[i : i + 1] = [
                t.stmt(f"gate_up, _ = self.gate_up_proj({fuser.inputs[-1]})\n"),
                new,
            ]
            break
    if len(fuser.inputs) != 1 or {gate, up} & t.self_attrs_used(cst.Module(fwd_body)):
        raise HfrewriteError(f"{name}: {NAME}: `act({gate}(x)) * {up}(x)` is not the only use of {gate}/{up}")
    return t.with_body(forward, fwd_body)


def rewrite_fused(cls: cst.ClassDef, mlp) -> cst.ClassDef:
    """A checkpoint-fused ``self.<gate_up> = nn.Linear(H, 2 * I)`` whose halves the
    analysis proved are gate and up: the layer loads the tensor as it is, and the forward
    is the block the analysis proved, ``down(act_and_mul(gate_up(x)))``."""
    name, attr, act = cls.name.value, mlp.gate.attr, mlp.act_attr or _ACT_FN
    if not mlp.act_attr:  # torch's function, called in forward (ChatGLM's swiglu closure)
        init = t.find_method(cls, "__init__")
        cls = t.set_method(
            cls, t.with_body(init, _with_act_fn(name, list(init.body.body), init, mlp.activation))
        )
    init, body, where = t.init_assignments(cls, (attr, act), NAME)
    call, a = t.assigned_value(body[where[attr]]), t.assigned_value(body[where[act]])
    size_out, intermediate = t.arg(call, 1, "out_features"), None
    if isinstance(size_out, cst.BinaryOperation) and isinstance(size_out.operator, cst.Multiply):
        sides = (size_out.left, size_out.right)  # 2 * I, or I * 2
        intermediate = next((o for s, o in (sides, sides[::-1]) if m.matches(s, m.Integer("2"))), None)
    if not builds(call, nn_call("Linear")) or intermediate is None:
        raise HfrewriteError(f"{name}: {NAME}: self.{attr} is not nn.Linear(H, 2 * I)")
    if mlp.act_attr and not (isinstance(a, cst.Subscript) and t.dotted(a.value) == "ACT2FN"):
        raise HfrewriteError(f"{name}: {NAME}: {act} is not ACT2FN[...]")
    bias = t.arg(call, 2, "bias")
    merged = t.stmt(
        "# The checkpoint holds gate and up in one tensor, which this layer loads as it is.\n"
        f"self.{attr} = MergedColumnParallelLinear(\n"
        f"    {t.code(t.arg(call, 0, 'in_features'))},\n    [{t.code(intermediate)}] * 2,\n"
        f"    bias={t.code(bias) if bias is not None else 'True'},\n"
        f'    quant_config=quant_config,\n    prefix=f"{{prefix}}.{attr}",\n)\n'
    )
    body[where[attr]] = merged.with_changes(
        leading_lines=[*body[where[attr]].leading_lines, *merged.leading_lines]
    )
    if mlp.act_attr:
        body[where[act]] = t.stmt(
            f"self.{act} = get_act_and_mul_fn({t.code(a.slice[0].slice.value)})\n"
        ).with_changes(leading_lines=body[where[act]].leading_lines)
    forward = t.find_method(cls, "forward")
    x = [p.name.value for p in forward.params.params if p.name.value != "self"]
    if len(x) != 1:
        raise HfrewriteError(f"{name}: {NAME}: forward does not take one input")
    forward = t.with_body(
        forward,
        t.stmts(f"gate_up, _ = self.{attr}({x[0]})\nreturn self.{mlp.down.attr}(self.{act}(gate_up))\n"),
    )
    return t.set_method(t.set_method(cls, t.with_body(init, body)), forward)


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    mlp = ctx.plan.mlp
    if mlp is None or mlp.form is not MlpForm.AND_MUL:  # no dense MLP, or one row_parallel shards
        return PassResult(module=module)
    source = _traced_branches_built(t.find_class(module, mlp.module_class), mlp)
    if mlp.fused_gate_up:
        cls = rewrite_fused(source, mlp)
    else:
        cls = rewrite_mlp(
            source,
            mlp.gate.attr,
            mlp.up.attr,
            mlp.act_attr,
            mlp.activation,
        )
    sites = Sites()
    module = sites.replace_class(module, mlp.module_class, cls)
    return PassResult(
        module=module,
        imports=("MergedColumnParallelLinear", "get_act_and_mul_fn"),
        fused=(
            FusionRow(
                mlp.module_class,
                f"{mlp.gate.attr}+{mlp.up.attr} -> MergedColumnParallelLinear + {mlp.activation} *AndMul"
                if not mlp.fused_gate_up
                else f"{mlp.gate.attr} ([gate; up] in the checkpoint) -> MergedColumnParallelLinear + "
                f"{mlp.activation} *AndMul",
            ),
        ),
        matches=sites.count,
    )


def _inline_projections(body: list[cst.BaseStatement], attrs: set[str]) -> list[cst.BaseStatement]:
    """``a1 = self.w1(x)`` ... ``a1 * F.silu(a2)`` (Qwen) as ``self.w1(x) * F.silu(self.w2(x))``:
    a local holding one projection's output, read once afterwards and never re-assigned,
    replaced by the call at its use."""
    for attr in sorted(attrs):
        for i, s in enumerate(body):
            assign = s.body[0] if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 else None
            if not (
                isinstance(assign, cst.Assign)
                and len(assign.targets) == 1
                and isinstance(assign.targets[0].target, cst.Name)
                and isinstance(assign.value, cst.Call)
                and m.matches(assign.value.func, self_attr(attr))
            ):
                continue
            name, rest = assign.targets[0].target.value, body[i + 1 :]
            uses = sum(t.code(r).count(name) for r in rest)  # textual upper bound, checked below
            readers = [j for j, r in enumerate(rest) if name in t.names_used(r)]
            if len(readers) != 1 or uses != 1 or any(name in _assigned(r) for r in rest):
                continue
            j = readers[0]
            rest[j] = t.replace_names(rest[j], {name: assign.value})
            body = [*body[:i], *rest]
            break
    return body


def _assigned(statement: cst.BaseStatement) -> set[str]:
    return {
        n
        for small in (statement.body if isinstance(statement, cst.SimpleStatementLine) else [])
        if isinstance(small, cst.Assign)
        for tgt in small.targets
        for n in t.root_names(tgt.target)
    }
