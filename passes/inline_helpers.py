"""Inline a helper method the attention or MLP forward calls, so that the projections are in it.

Matches, in the ``forward`` of the plan's attention and MLP classes, a statement
``a, b, ... = self.<helper>(args)`` whose method is defined in that class or one of its bases
in the file and calls one of the projections the plan found (Hub custom code that shares
``_project`` between its eager and SDPA classes): the passes that fuse projections read them
in ``forward``.

Emits the helper's body in place of the call: the arguments bound to its parameters first
(``param = arg``, left out where the argument is that very name and the helper never
reassigns it or the call assigns it), its locals renamed where the caller uses the same names, and its return value
assigned to the call's targets (pairs already equal left out). Inlining is exact Python
semantics: nothing is proven or replaced here; the later passes prove their sites as before.

Preconditions (otherwise the call stays): the helper has no decorators, takes ``self`` and
plain parameters (no ``*args``, ``**kwargs``, keyword-only ones), ends with its only
``return``, defines no functions, lambdas or generators and names no ``super``/``__class__``;
the call passes no ``*``/``**``;
no name the helper reads from the module is assigned in the caller.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.local_names import names_bound, target_names
from hfrewrite.emit.pass_api import PassContext, PassResult, Sites

NAME = "inline_helpers"
_SCOPES = (cst.FunctionDef, cst.Lambda, cst.ClassDef, cst.Yield, cst.Global, cst.Nonlocal)


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    sites = Sites()
    plan = ctx.plan
    targets = {getattr(plan.attention, "module_class", ""), plan.mlp.module_class if plan.mlp else ""}
    projections = _projections(plan)
    for name in sorted(targets - {""}):
        cls = next((n for n in module.body if isinstance(n, cst.ClassDef) and n.name.value == name), None)
        forward = cls and t.find_method(cls, "forward")
        if forward is None:
            continue
        body, inlined = [], 0
        for statement in forward.body.body:
            expanded = _inlined(module, cls, forward, statement, projections)
            inlined += expanded is not None
            body.extend(expanded if expanded is not None else [statement])
        if inlined:
            module = sites.replace_class(module, name, t.set_method(cls, t.with_body(forward, body)))
    return PassResult(module=module, matches=sites.count)


def _projections(plan) -> set[str]:
    """The attributes of the projections the fusing passes look for in a forward."""
    facts = [getattr(plan.attention, r, None) for r in ("q", "k", "v")]
    if plan.mlp is not None:
        facts += [plan.mlp.gate, plan.mlp.up, plan.mlp.down]
    return {f.attr for f in facts if f is not None}


def _inlined(
    module: cst.Module,
    cls: cst.ClassDef,
    caller: cst.FunctionDef,
    statement: cst.BaseStatement,
    projections: set[str],
) -> list[cst.BaseStatement] | None:
    """The statements replacing ``statement`` when it calls an inlinable helper that calls
    one of the ``projections``, else None."""
    if not m.matches(
        statement, m.SimpleStatementLine(body=[m.Assign(value=m.Call(func=m.Attribute(m.Name("self"))))])
    ):
        return None
    assign: cst.Assign = statement.body[0]
    call: cst.Call = assign.value
    helper = _method(module, cls, call.func.attr.value)
    if helper is None or not _inlinable(helper) or any(a.star for a in call.args):
        return None
    if not t.self_attrs_used(helper.body) & projections:
        return None  # nothing a fusing pass looks for (persimmon's _split_heads is theirs)
    if {"super", "__class__"} & t.root_names(helper.body):
        return None  # resolved against the class that defines the helper, not the caller's
    bound = _bound(call, helper)
    if bound is None:
        return None
    *steps, last = [s for i, s in enumerate(helper.body.body) if not (i == 0 and _is_docstring(s))]
    caller_names = t.names_used(caller)
    assigned = names_bound(helper.body)
    if (t.root_names(helper.body) - assigned - set(bound) - {"self"}) & names_bound(caller):
        return None  # a module-level name the helper reads is a local of the caller
    taken = caller_names | assigned | set(bound)
    targets = set().union(*(target_names(a.target) for a in assign.targets))
    renames, bindings = {}, []
    for param, arg in bound.items():
        if m.matches(arg, m.Name(param)) and (param not in assigned or param in targets):
            continue  # the caller's own variable: unchanged, or overwritten by the call anyway
        if param in caller_names:
            renames[param] = _fresh(taken, param)
        bindings.append(f"{renames.get(param, param)} = {t.code(arg)}\n")
    for local in sorted(assigned - set(bound) - targets - {"_"}):
        if local in caller_names:
            renames[local] = _fresh(taken, local)
    steps = [t.replace_names(s, renames) for s in steps]
    returned = t.replace_names(last.body[0].value, renames)
    out = [*(t.stmts("".join(bindings)) if bindings else []), *steps, *_assign_returned(assign, returned)]
    return [out[0].with_changes(leading_lines=statement.leading_lines), *out[1:]] if out else []


def _fresh(taken: set[str], name: str) -> str:
    """A fresh name for ``name`` (``name_``, ``name__``...), recorded in ``taken``."""
    fresh = f"{name}_"
    while fresh in taken:
        fresh += "_"
    taken.add(fresh)
    return fresh


def _assign_returned(assign: cst.Assign, returned: cst.BaseExpression) -> list[cst.BaseStatement]:
    """``targets = returned``, tuple pairs that are already equal left out."""
    (target,) = assign.targets if len(assign.targets) == 1 else (None,)
    if (
        target is not None
        and isinstance(target.target, cst.Tuple)
        and isinstance(returned, cst.Tuple)
        and len(target.target.elements) == len(returned.elements)
    ):
        pairs = [
            (t.code(a.value), t.code(b.value))
            for a, b in zip(target.target.elements, returned.elements)
            if not a.value.deep_equals(b.value)
        ]
        if not pairs:
            return []
        return t.stmts(f"{', '.join(a for a, _ in pairs)} = {', '.join(b for _, b in pairs)}\n")
    names = " = ".join(t.code(a.target) for a in assign.targets)
    return t.stmts(f"{names} = {t.code(returned)}\n")


def _method(module: cst.Module, cls: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    """``name`` as the class resolves it: its own ``def``, else its bases' in the file, in order."""
    found = t.find_method(cls, name)
    if found is not None:
        return found
    classes = {n.name.value: n for n in module.body if isinstance(n, cst.ClassDef)}
    for base in cls.bases:
        base_cls = classes.get(t.code(base.value))
        if base_cls is None:
            return None  # a base outside the file could define it first
        found = _method(module, base_cls, name)
        if found is not None:
            return found
    return None


def _inlinable(helper: cst.FunctionDef) -> bool:
    params = helper.params
    if helper.decorators or params.posonly_params or params.kwonly_params:
        return False
    if not isinstance(params.star_arg, cst.MaybeSentinel) or params.star_kwarg is not None:
        return False
    if not params.params or params.params[0].name.value != "self":
        return False
    last = helper.body.body[-1]
    returns = [n for n in t.walk(helper.body) if isinstance(n, cst.Return)]
    ends_with_return = m.matches(last, m.SimpleStatementLine(body=[m.Return(value=m.DoNotCare())]))
    return (
        ends_with_return
        and returns == [last.body[0]]
        and last.body[0].value is not None
        and not any(isinstance(n, _SCOPES) for n in t.walk(helper.body))
    )


def _bound(call: cst.Call, helper: cst.FunctionDef) -> dict[str, cst.BaseExpression] | None:
    """Parameter -> argument expression (defaults for those not passed), or None."""
    bound: dict[str, cst.BaseExpression] = {}
    for p in helper.params.params[1:]:
        at = t.bound_arg(call, helper, True, p.name.value)  # True: `self` is not passed
        if at is None or (at < 0 and not _literal(p.default)):
            return None  # a default is evaluated where the helper is defined: literals only
        bound[p.name.value] = call.args[at].value if at >= 0 else p.default
    return bound


def _literal(node: cst.BaseExpression | None) -> bool:
    return isinstance(node, cst.BaseNumber | cst.SimpleString) or m.matches(
        node, m.Name("None") | m.Name("True") | m.Name("False")
    )


def _is_docstring(statement: cst.BaseStatement) -> bool:
    return m.matches(
        statement, m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString() | m.ConcatenatedString())])
    )
