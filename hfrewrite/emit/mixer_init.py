"""What a hybrid layer's ``__init__`` gets around the mixer vLLM builds
(passes/hybrid_mixer.py): the checks of the config values the proof assumed, first; and no
earlier construction of the mixer's attribute that a later test overwrites."""

from __future__ import annotations

import ast

import libcst as cst

from hfrewrite.emit import cst_tools as t


def without_overwritten(init: cst.FunctionDef, attr: str) -> cst.FunctionDef:
    """``__init__`` without a ``self.<attr> = ...`` that a later ``if`` overwrites in each of
    its branches before anything reads it (MiniMax's first ``self.self_attn =
    MiniMaxAttention(...)``, then one class or the other by layer): vLLM registers every
    attention it builds, unreachable or not."""
    body = list(init.body.body)

    def assigns(statements) -> bool:
        return any(
            isinstance(x, cst.SimpleStatementLine) and t.self_attr_assigned(x) == attr for x in statements
        )

    for i, statement in enumerate(body):
        if not (isinstance(statement, cst.SimpleStatementLine) and t.self_attr_assigned(statement) == attr):
            continue
        for j in range(i + 1, len(body)):
            later = body[j]
            overwritten = (
                isinstance(later, cst.If)
                and isinstance(later.orelse, cst.Else)
                and assigns(later.body.body)
                and assigns(later.orelse.body.body)
                and f"self.{attr}" not in t.code(later.test)
            )
            if overwritten:
                return t.with_body(init, body[:i] + body[i + 1 :])
            if f"self.{attr}" in t.code(later):
                break
    return init


def fixed_check(condition: str, why: str) -> cst.BaseStatement:
    """A check that the config meets ``condition``, as the one the file was proven with."""
    message = f"hfrewrite: this file needs {condition}: {why}"
    return t.stmt(f"if {_negated(condition)}:\n    raise ValueError({message!r})\n")


def _negated(condition: str) -> str:
    """``a != b`` for ``a == b``, ``a not in b`` for ``a in b``, ``a is b`` for ``a is not b``,
    else ``not (...)``."""
    tree = ast.parse(condition, mode="eval").body
    flipped = {ast.Eq: ast.NotEq, ast.In: ast.NotIn, ast.IsNot: ast.Is}
    if isinstance(tree, ast.Compare) and len(tree.ops) == 1 and type(tree.ops[0]) in flipped:
        tree.ops = [flipped[type(tree.ops[0])]()]
        return ast.unparse(tree)
    return f"not ({condition})"
