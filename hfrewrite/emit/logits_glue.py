"""The source's steps around its lm_head, carried into vLLM's ``compute_logits`` for
``passes/vllm_model_interface.py``: the head's bias, the post-processing of the logits
(softcap, scale) and a constant scale of the head's input."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.embedding_glue import GLUE_NAMES, assigned_names
from hfrewrite.errors import HfrewriteError

NAME = "vllm_model_interface"

_LOGITS_NAMES = GLUE_NAMES | {"logits"}


def logits_statements(forward: cst.FunctionDef | None, lm_head: str) -> list[cst.BaseStatement]:
    """The source's statements right after ``logits = self.<lm_head>(...)`` that rewrite
    ``logits`` from ``logits``, ``self`` and libraries only (softcap, scale)."""
    body = list(forward.body.body) if forward is not None else []
    at = next(
        (
            i
            for i, s in enumerate(body)
            if t.self_attr_assigned(s) is None
            and isinstance(s, cst.SimpleStatementLine)
            and isinstance(s.body[0], cst.Assign)
            and m.matches(s.body[0].targets[0].target, m.Name("logits"))
            and _head_call(s.body[0].value, lm_head) is not None
        ),
        None,
    )
    if at is None:
        return []  # nothing to carry; a post-processing the analysis saw then fails closed
    carried = _same_line(body[at].body[0].value, lm_head)
    for s in body[at + 1 :]:
        if "logits" not in assigned_names(s) or not t.root_names(s) <= _LOGITS_NAMES:
            break
        carried.append(s)
    return carried


def _head_call(value: cst.BaseExpression, lm_head: str) -> cst.Call | None:
    """``self.<lm_head>(...)``, alone or times an expression on the line (Falcon-H1's
    ``self.lm_head(...) * self.model.lm_head_multiplier``)."""
    if t.call_name(value) == f"self.{lm_head}":
        return value
    if isinstance(value, cst.BinaryOperation) and t.call_name(value.left) == f"self.{lm_head}":
        return value.left
    return None


def _same_line(value: cst.BaseExpression, lm_head: str) -> list[cst.BaseStatement]:
    """What the lm_head's line does to its logits besides the call: ``logits = logits * x``,
    carried as any later statement is (a factor of 1 on the traced config leaves the logits
    as they are, so the example run cannot tell it is there)."""
    if not isinstance(value, cst.BinaryOperation):
        return []
    rest = value.with_changes(left=cst.Name("logits"))
    if not t.root_names(value.right) <= _LOGITS_NAMES:
        raise HfrewriteError(
            f"{NAME}: the lm_head's line computes {t.code(value)}, which the file would not keep"
        )
    return t.stmts(f"logits = {t.code(rest)}\n")


def head_has_bias(statements: list[cst.BaseStatement]) -> bool:
    """Whether the lm_head is built as ``ParallelLMHead(..., bias=<not False>)``."""
    found = []

    class _Head(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            if t.call_name(call) == "ParallelLMHead":
                found.extend(
                    a
                    for a in call.args
                    if a.keyword and a.keyword.value == "bias" and not m.matches(a.value, m.Name("False"))
                )

    for s in statements:
        s.visit(_Head())
    return bool(found)


def adding_head_bias(tpl: cst.ClassDef, lm_head: str) -> cst.ClassDef:
    """``tpl`` whose compute_logits adds the lm_head's bias to the logits."""
    logits = t.find_method(tpl, "compute_logits")
    return t.set_method(
        tpl,
        t.with_body(
            logits,
            t.stmts(f"return self.logits_processor(self.{lm_head}, hidden_states, self.{lm_head}.bias)\n"),
        ),
    )


def carrying_logits(
    tpl: cst.ClassDef, lm_head: str, carried: list[cst.BaseStatement], bias: bool
) -> cst.ClassDef:
    """``tpl`` whose compute_logits runs the source's ``carried`` statements on the logits,
    under a ``logits is not None`` guard (a lone ``if`` has its test joined to it)."""
    logits = t.find_method(tpl, "compute_logits")
    tpl = t.set_method(
        tpl,
        t.with_body(
            logits,
            [
                *t.stmts(
                    f"logits = self.logits_processor(self.{lm_head}, hidden_states"
                    f"{f', self.{lm_head}.bias' if bias else ''})\n"
                    "# the source's post-processing of the logits\nif logits is not None:\n    pass\n"
                ),
                t.stmt("return logits\n"),
            ],
        ),
    )
    logits = t.find_method(tpl, "compute_logits")
    guard = logits.body.body[1]
    inner = carried[0] if len(carried) == 1 else None
    if isinstance(inner, cst.If) and inner.orelse is None:  # one test: joined to the guard's
        test = t.code(inner.test)
        if isinstance(inner.test, (cst.BooleanOperation, cst.IfExp, cst.Lambda, cst.NamedExpr)):
            test = f"({test})"
        guard = guard.with_changes(test=t.expr(f"logits is not None and {test}"))
        carried = list(inner.body.body)
    logits = t.with_body(
        logits,
        [
            logits.body.body[0],
            guard.with_changes(body=guard.body.with_changes(body=carried)),
            logits.body.body[2],
        ],
    )
    return t.set_method(tpl, logits)


def scaling_head_input(tpl: cst.ClassDef, forward: cst.FunctionDef, plan) -> cst.ClassDef:
    """compute_logits first scales the hidden states as the source's ``self.<lm_head>(<expr>)``
    does (the analysis proved a constant factor): ``<expr>`` on vLLM's ``hidden_states``."""
    expr = _head_input(forward, plan.lm_head)
    roots = t.root_names(expr) - {"self"} if expr is not None else set()
    if len(roots) != 1:
        raise HfrewriteError(f"{plan.architecture}: {NAME}: the lm_head's scaled input is not one expression")
    code = t.code(t.replace_names(expr, {roots.pop(): "hidden_states"}))
    logits = t.find_method(tpl, "compute_logits")
    scale = t.stmts(f"# as the source scales the lm_head's input\nhidden_states = {code}\n")
    return t.set_method(tpl, t.with_body(logits, [*scale, *logits.body.body]))


def scales_head_input(forward: cst.FunctionDef | None, lm_head: str) -> bool:
    """The source's forward hands its lm_head an arithmetic expression of one name (``x /
    self.config.logits_scaling``): the file carries it even where the traced config's factor
    is 1, which the example run cannot tell from no factor at all."""
    expr = _head_input(forward, lm_head)
    return isinstance(expr, cst.BinaryOperation) and len(t.root_names(expr) - {"self"}) == 1


def _head_input(forward: cst.FunctionDef | None, lm_head: str) -> cst.BaseExpression | None:
    """The argument of the forward's one ``self.<lm_head>(x)`` call as one expression of the
    base model's output (``_scaled_input``); None where there is not one such call."""
    calls = [
        n
        for n in (t.walk(forward.body) if forward is not None else ())
        if isinstance(n, cst.Call) and t.call_name(n) == f"self.{lm_head}" and len(n.args) == 1
    ]
    return _scaled_input(forward, calls[0].args[0].value) if len(calls) == 1 else None


def _scaled_input(forward: cst.FunctionDef, arg: cst.BaseExpression) -> cst.BaseExpression | None:
    """The lm_head's argument as one expression of the base model's output: the selection
    of the tokens to keep (``x[:, slice_indices, :]``, vLLM selects them itself) dropped,
    and the forward's own rescaling of ``x`` (``x = x / self.config.logits_scaling``,
    minicpm3) substituted, back to where ``x`` is first read off another name. Where ``x`` is
    rebound otherwise on the way (augmented, under a branch), None: not one expression."""
    call = arg
    if m.matches(arg, m.Subscript(value=m.Name())):
        arg = arg.value
    roots = t.root_names(arg) - {"self"}
    if len(roots) != 1:
        return arg  # not one name's: the caller refuses
    body = forward.body.body
    at = next(i for i, s in enumerate(body) if any(n is call for n in t.walk(s)))
    name, expr = roots.pop(), arg
    for statement in reversed(body[:at]):
        line = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        if not m.matches(line, m.Assign(targets=[m.AssignTarget(target=m.Name(name))])):
            if _binds(statement, name):  # `x *= 2`, or `x = ...` under a branch: not one expression
                return None
            continue
        if t.root_names(line.value) - {"self"} != {name}:
            break  # read off the base model's output: ``x`` is that output
        value = (
            line.value
            if isinstance(expr, cst.Name)
            else line.value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        )
        expr = t.replace_names(expr, {name: value})
    return expr


def _binds(statement: cst.BaseStatement, name: str) -> bool:
    """``statement`` assigns ``name`` anywhere (plainly, augmented, under a branch or a loop)."""
    target = m.Name(name)
    return bool(
        m.findall(statement, m.AssignTarget(target=target))
        or m.findall(statement, m.AugAssign(target=target))
        or m.findall(statement, m.AnnAssign(target=target))
        or m.findall(statement, m.For(target=target))
    )
