"""A carried forward called without the Hugging Face inputs vLLM does not give.

vLLM calls a carried decoder layer as ``layer(positions, hidden_states)``, so each other
parameter takes its default, as Python binds it. Where that default is a literal
(``use_cache=False``, ``layer_past=None``) and the body never rebinds the parameter, its
reads are replaced by the literal, and an ``if`` whose test is then made of literals alone
(``if use_cache:``, ``if layer_past is not None:``) is reduced to the branch it takes.
"""

from __future__ import annotations

import ast

import libcst as cst

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.local_names import names_bound

_LITERAL_NODES = (ast.Expression, ast.Constant, ast.UnaryOp, ast.Not, ast.BoolOp, ast.And, ast.Or)
_LITERAL_NODES += (ast.Compare, ast.Is, ast.IsNot, ast.Eq, ast.NotEq, ast.Load)


def bound_to_defaults(fn: cst.FunctionDef, dropped: set[str]) -> tuple[cst.BaseSuite, set[str]]:
    """``fn``'s body with the ``dropped`` parameters that have literal defaults read as
    those defaults and the ``if`` statements this makes constant reduced; the names bound."""
    params = (*fn.params.params, *fn.params.kwonly_params)
    stored = names_bound(fn.body)
    defaults = {
        p.name.value: p.default
        for p in params
        if p.name.value in dropped
        and p.default is not None
        and _literal(p.default)
        and p.name.value not in stored
    }
    if not defaults:
        return fn.body, set()
    body = t.replace_names(fn.body, dict(defaults))
    return body.visit(_ConstantBranches()), set(defaults)


def _literal(node: cst.BaseExpression) -> bool:
    try:
        tree = ast.parse(t.code(node).strip(), mode="eval")
    except SyntaxError:
        return False
    return all(isinstance(n, _LITERAL_NODES) for n in ast.walk(tree))


class _ConstantBranches(cst.CSTTransformer):
    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock):
        body = [kept for s in updated.body for kept in (_reduced(s) if isinstance(s, cst.If) else [s])]
        return updated.with_changes(body=body or [cst.SimpleStatementLine([cst.Pass()])])


def _reduced(node: cst.If) -> list[cst.BaseStatement]:
    """The statements ``node`` runs when its test is literal; ``node`` otherwise, with a
    literal ``elif`` further down reduced the same way."""
    if not _literal(node.test):
        rest = node.orelse
        if isinstance(rest, cst.If) and _literal(rest.test):
            stmts = _reduced(rest)
            return [node.with_changes(orelse=cst.Else(cst.IndentedBlock(stmts)) if stmts else None)]
        return [node]
    if eval(compile(t.code(node.test).strip(), "<test>", "eval"), {"__builtins__": {}}):
        return list(node.body.body)
    if isinstance(node.orelse, cst.If):  # an elif: its test decides
        return _reduced(node.orelse)
    return list(node.orelse.body.body) if node.orelse else []
