"""Refuse configs that flip a config switch the emitted file no longer tests.

Matches each config switch the analysis found in a forward of the causal LM, the base model,
the decoder layer, the attention, the MLP or the MoE block, and in the attention's
``is_causal`` (``ModelPlan.forward_switches``: config form and traced value), and in the
methods those forwards call (``ModelPlan.helper_switches``: Falcon's ``_split_heads``). A
switch the emitted class still tests (a branch the file carries, or a guard another pass
wrote) is left as it is; for a helper's switch, only a test in a method or a guard counts.
Emits, for a switch the rewrite dropped (a template forward, a replaced attention), a guard
at the top of the class's ``__init__``, before any layer is built:

    if config.use_bidirectional_attention:
        raise NotImplementedError("hfrewrite: Gemma3TextModel was converted for configs where ...")

Tests are compared as syntax trees, in the form ``__init__`` evaluates (an optional part's
``self.shared_mlp is None`` as the test under which ``__init__`` builds it). Tests of
transformers' implementation selectors alone (``config._attn_implementation``) get none, nor
does an optional part's test where the emitted ``__init__`` still builds the part under it
and the class reads every attribute that test decides (ERNIE's shared experts, handed to
vLLM's MoE, None or not).

Preconditions: the class's ``__init__`` has ``config`` (a parameter, or assigned from
``vllm_config``) before the guards.
"""

from __future__ import annotations

import ast

import libcst as cst

from hfrewrite.analyze.optional_parts import negated, optional_parts, optional_tests
from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.after_split import reads_own_attribute
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites
from hfrewrite.emit.taken_init import one_guard_per_condition
from hfrewrite.errors import HfrewriteError

NAME = "config_guards"


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    by_class: dict[str, list[tuple[str, bool, bool]]] = {}
    for helper, switches in ((False, ctx.plan.forward_switches), (True, ctx.plan.helper_switches)):
        for cls, test, value in switches:
            by_class.setdefault(cls, []).append((test, value, helper))
    sites, rows = Sites(), []
    for name, switches in by_class.items():
        cls = next((n for n in module.body if isinstance(n, cst.ClassDef) and n.name.value == name), None)
        init = cls and t.find_method(cls, "__init__")
        if init is None:
            continue
        # a helper's or a forward's switch is carried only by a method (or a guard): a test
        # __init__ still makes (a size, LFM2's layer kind) does not show that the emitted
        # forward takes the other branch; __init__'s own switches are carried by __init__
        in_init = {test for owner, test in ctx.plan.init_switches_tested if owner == name}
        tested = {False: _tested(cls), True: _tested(cls, methods_only=True)}
        dropped = list(
            dict.fromkeys(
                (test, value)
                for test, value, helper in switches
                if ast.dump(ast.parse(test, mode="eval").body) not in tested[helper or test not in in_init]
                and not _selector(test)
            )
        )
        dropped = [(test, value) for test, value in dropped if not _still_built(cls, test)]
        if not dropped:
            continue
        builds = [test for test, _ in dropped if reads_own_attribute(test)]
        if builds:  # fixed only once __init__ has built its parts: a guard at its top decides nothing
            raise HfrewriteError(
                f"{name}: {NAME}: the forward's `{builds[0]}` branch is dropped and no test "
                "__init__ can make before it builds that attribute refuses the configs that take it"
            )
        guards = one_guard_per_condition("".join(_guard(name, test, value) for test, value in dropped))
        cls = t.set_method(cls, t.with_body(init, t.guards_first(list(init.body.body), guards)))
        module = sites.replace_class(module, name, cls)
        rows += [
            FusionRow(name, f"config switch `{test}` ({value}) not carried: refused in __init__")
            for test, value in dropped
        ]
    return PassResult(module=module, fused=tuple(rows), matches=sites.count)


def _selector(test: str) -> bool:
    """A test of transformers' implementation selectors alone (Falcon's
    ``config._attn_implementation == "sdpa"``): it picks how the source computes its
    attention, not what (transformers' contract), and the rewrite replaced every
    implementation by vLLM's attention: no config needs refusing on it."""
    read = {n.attr for n in ast.walk(ast.parse(test, mode="eval")) if isinstance(n, ast.Attribute)}
    return bool(read) and all(a.startswith("_") and a.endswith("_implementation") for a in read)


def _tested(cls: cst.ClassDef, methods_only: bool = False) -> set[str]:
    """The switches every ``if`` test in ``cls`` (``methods_only``: in its methods other than
    ``__init__``, and ``__init__``'s guards) decides on (``_tests_within``), in ``__init__``'s config form, as
    ``ast.dump`` strings."""
    exprs = t.init_exprs(cls) if t.find_method(cls, "__init__") else {}
    exprs.setdefault("config", "config")
    found: set[str] = set()

    class _Tests(cst.CSTVisitor):
        def visit_If(self, node: cst.If) -> None:
            _add(node.test)

        def visit_IfExp(self, node: cst.IfExp) -> None:
            _add(node.test)

    optional = optional_tests(
        t.code(t.find_method(cls, "__init__")) if t.find_method(cls, "__init__") else ""
    )

    def _add(test: cst.BaseExpression) -> None:
        # `self.shared_mlp is None`: the test under which __init__ builds the part, negated
        text = optional(" ".join(t.code(test).split()))
        try:
            text = t.config_test(text, {attr: f"({value})" for attr, value in exprs.items()})
        except ValueError:
            pass
        found.update(ast.dump(n) for n in _tests_within(ast.parse(text, mode="eval").body))

    if methods_only:  # and the guards __init__ already raises (another pass wrote them)
        for member in cls.body.body:
            if isinstance(member, cst.FunctionDef) and member.name.value != "__init__":
                member.visit(_Tests())
        for statement in t.find_method(cls, "__init__").body.body:
            if _raises_only(statement):
                _add(statement.test)
    else:
        cls.visit(_Tests())
    return found


def _still_built(cls: cst.ClassDef, test: str) -> bool:
    """The emitted ``__init__`` builds an optional part under ``test`` (or its negation), and
    the class reads every attribute that test decides there (ERNIE's ``shared_experts``,
    handed to vLLM's MoE, None or not): the class carries both configs as the source does.
    An attribute it never reads (Granite-4.0's ``mamba`` once no layer calls it) carries
    nothing."""
    tree = ast.parse(t.code(cls)).body[0]
    init = next((f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    if init is None:
        return False
    read = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and ast.unparse(n.value) == "self"
    }
    switch = ast.parse(test, mode="eval").body
    wanted = {ast.dump(switch), ast.dump(negated(switch))}  # built when it holds, or when it fails
    optional = {attr for attr, part in optional_parts(init).items() if ast.dump(part) in wanted}
    decided = set(optional)
    for statement in init.body:
        if isinstance(statement, ast.If) and ast.dump(statement.test) in wanted:
            decided |= {
                n.attr
                for n in ast.walk(statement)
                if isinstance(n, ast.Attribute)
                and isinstance(n.ctx, ast.Store)
                and ast.unparse(n.value) == "self"
            }
    return bool(optional) and decided <= read


def _raises_only(statement: cst.BaseStatement) -> bool:
    """``if <test>: raise ...`` with nothing else: a guard."""
    return (
        isinstance(statement, cst.If)
        and statement.orelse is None
        and len(statement.body.body) == 1
        and isinstance(statement.body.body[0], cst.SimpleStatementLine)
        and isinstance(statement.body.body[0].body[0], cst.Raise)
    )


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
