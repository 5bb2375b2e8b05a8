"""Refuse configs that flip a config switch the emitted file no longer tests.

Matches each config switch the analysis found in a forward of the causal LM, the base model,
the decoder layer, the attention, the MLP or the MoE block, and in the attention's
``is_causal`` (``ModelPlan.forward_switches``: config form and traced value). A switch the
emitted class still tests (a branch the file carries, or a guard another pass wrote) is left
as it is. Emits, for a switch the rewrite dropped (a template forward, a replaced
attention), a guard at the top of the class's ``__init__``, before any layer is built:

    if config.use_bidirectional_attention:
        raise NotImplementedError("hfrewrite: Gemma3TextModel was converted for configs where ...")

Tests are compared as syntax trees, in the form ``__init__`` evaluates.

Preconditions: the class's ``__init__`` has ``config`` (a parameter, or assigned from
``vllm_config``) before the guards.
"""

from __future__ import annotations

import ast

import libcst as cst

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites

NAME = "config_guards"


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    by_class: dict[str, list[tuple[str, bool]]] = {}
    for cls, test, value in ctx.plan.forward_switches:
        by_class.setdefault(cls, []).append((test, value))
    sites, rows = Sites(), []
    for name, switches in by_class.items():
        cls = next((n for n in module.body if isinstance(n, cst.ClassDef) and n.name.value == name), None)
        init = cls and t.find_method(cls, "__init__")
        if init is None:
            continue
        tested = _tested(cls)
        dropped = [
            (test, value)
            for test, value in switches
            if ast.dump(ast.parse(test, mode="eval").body) not in tested
        ]
        if not dropped:
            continue
        refused: dict[str, str] = {}  # one guard per refused condition (`not x` True is `x` False)
        for test, value in dropped:
            guard = _guard(name, test, value)
            refused.setdefault(ast.dump(ast.parse(guard.splitlines()[0][3:-1], mode="eval").body), guard)
        guards = "".join(refused.values())
        cls = t.set_method(cls, t.with_body(init, t.guards_first(list(init.body.body), guards)))
        module = sites.replace_class(module, name, cls)
        rows += [
            FusionRow(name, f"config switch `{test}` ({value}) not carried: refused in __init__")
            for test, value in dropped
        ]
    return PassResult(module=module, fused=tuple(rows), matches=sites.count)


def _tested(cls: cst.ClassDef) -> set[str]:
    """The switches every ``if`` test in ``cls`` decides on (``_tests_within``), in
    ``__init__``'s config form, as ``ast.dump`` strings."""
    exprs = t.init_exprs(cls) if t.find_method(cls, "__init__") else {}
    exprs.setdefault("config", "config")
    found: set[str] = set()

    class _Tests(cst.CSTVisitor):
        def visit_If(self, node: cst.If) -> None:
            _add(node.test)

        def visit_IfExp(self, node: cst.IfExp) -> None:
            _add(node.test)

    def _add(test: cst.BaseExpression) -> None:
        text = " ".join(t.code(test).split())
        try:
            text = t.config_test(text, exprs)
        except ValueError:
            pass
        found.update(ast.dump(n) for n in _tests_within(ast.parse(text, mode="eval").body))

    cls.visit(_Tests())
    return found


def _tests_within(tree: ast.expr) -> list[ast.expr]:
    """The test itself, what a ``not`` negates and the operands of ``and``/``or``: the
    switches a test decides on (not every sub-expression: ``config.x`` is not decided by
    ``config.x.y > 1``)."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            todo.append(node.operand)
        elif isinstance(node, ast.BoolOp):
            todo.extend(node.values)
    return out


def _guard(cls: str, test: str, value: bool) -> str:
    """``if <the other branch>: raise``: a true traced value refuses the test's negation."""
    tree = ast.parse(test, mode="eval").body
    if value:
        other = (
            ast.unparse(tree.operand)
            if isinstance(tree, ast.UnaryOp) and isinstance(tree.op, ast.Not)
            else f"not ({test})"
        )
    else:
        other = test
    shown = test.replace('"', "'")
    return (
        f"if {other}:\n"
        f'    raise NotImplementedError("hfrewrite: {cls} was converted for configs where `{shown}` is {value}: '
        'its forward takes another branch here")\n'
    )
