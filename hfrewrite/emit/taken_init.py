"""A config switch of an ``__init__`` (analyze/branches.py ``init_switches``: a test on its
``config`` alone) replaced by the branch the traced config took; guards refuse the configs
that take another. Used for a MoE block's experts (DeepSeek's ``ep_size``) and the base
model's parts (OPT's final norm and embedding projections)."""

from __future__ import annotations

import ast
import re

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t


def taken_init_branches(
    init: cst.FunctionDef, switches, cls: str, exprs: dict[str, str] | None = None, keep=None
) -> tuple[cst.FunctionDef, str]:
    """``__init__`` with each ``if`` on a config switch of ``switches`` ((test, traced value),
    analyze/branches.py ``init_switches``) replaced by the branch the traced config took,
    and the guards refusing configs that take another; ``exprs``: the class's ``init_exprs``,
    for tests on attributes ``__init__`` sets from the config (``if self.use_expert_bias:``);
    ``keep``: a predicate on the ``if`` statements left as they are (a branch the caller
    carries both ways, ernie's optional shared expert)."""
    known = {ast.dump(ast.parse(test, mode="eval").body): (test, value) for test, value in switches}
    taken = []

    def _key(test: cst.BaseExpression) -> str:
        text = f"({t.code(test).strip()})"  # a test over several lines parses in parentheses
        if exprs:
            try:
                text = t.config_test(text, {attr: f"({value})" for attr, value in exprs.items()})
            except ValueError:
                pass
        return ast.dump(ast.parse(text, mode="eval").body)

    class _Taken(cst.CSTTransformer):
        def __init__(self) -> None:
            self.elifs: set[int] = set()  # an elif is decided with the `if` it continues

        def visit_If(self, node: cst.If) -> None:
            if isinstance(node.orelse, cst.If):
                self.elifs.add(id(node.orelse))

        def leave_If(self, original: cst.If, updated: cst.If):
            found = None if keep is not None and keep(updated) else known.get(_key(updated.test))
            if found is None or id(original) in self.elifs:
                return updated
            if isinstance(updated.orelse, cst.If) and not found[1]:
                return updated  # the chain goes on: its elif decides
            taken.append(found)
            orelse = updated.orelse.body.body if isinstance(updated.orelse, cst.Else) else ()
            body = updated.body.body if found[1] else orelse
            return cst.FlattenSentinel([*body]) if body else cst.RemoveFromParent()

        def leave_IfExp(self, original: cst.IfExp, updated: cst.IfExp):
            none = [side for side in (updated.body, updated.orelse) if m.matches(side, m.Name("None"))]
            found = known.get(_key(updated.test)) if none else None
            if found is None:
                return updated
            taken.append(found)
            return updated.body if found[1] else updated.orelse

    init = init.visit(_Taken())
    if taken:
        init = t.with_body(init, _without_dead_nones(list(init.body.body)))
    return init, t.branch_guards(list(dict.fromkeys(taken)), {}, cls, "__init__")


def _without_dead_nones(body: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
    """``body`` less each ``self.x = None`` that a later statement of it assigns again with
    nothing between reading ``self.x`` (a part the taken branch now builds unconditionally:
    Granite-4.0's ``self.mamba = None`` before ``self.mamba = MambaMixer2(...)``)."""
    kept = []
    for i, statement in enumerate(body):
        attr = t.self_attr_assigned(statement)
        value = t.assigned_value(statement) if attr else None
        if attr and m.matches(value, m.Name("None")):
            later = next((j for j in range(i + 1, len(body)) if t.self_attr_assigned(body[j]) == attr), None)
            between = body[i + 1 : later] if later is not None else None
            if (
                between is not None
                and not any(attr in t.self_attrs_used(s) for s in between)
                and (attr not in t.self_attrs_used(t.assigned_value(body[later])))
            ):
                continue
        kept.append(statement)
    return kept


def with_traced_branches(
    cls: cst.ClassDef, switches, exprs: dict[str, str] | None = None, keep=None
) -> cst.ClassDef:
    """``cls`` whose ``__init__`` takes the branch of each switch the traced config took
    (:func:`taken_init_branches`), the guards refusing the others first in it."""
    init, guards = taken_init_branches(t.find_method(cls, "__init__"), switches, cls.name.value, exprs, keep)
    return t.set_method(cls, t.with_body(init, t.guards_first(list(init.body.body), guards)))


def one_guard_per_condition(guards: str) -> str:
    """``guards`` (``if <condition>:`` blocks) with one guard per refused condition, the
    first one's message kept: two switches refusing the same condition (``not x`` True is
    ``x`` False, a switch of both ``__init__`` and the router) make one guard."""
    kept: dict[str, str] = {}
    for guard in re.split(r"(?m)^(?=if )", guards):
        if guard:
            condition = ast.parse(guard.splitlines()[0][3:-1], mode="eval").body
            kept.setdefault(ast.dump(condition), guard)
    return "".join(kept.values())
