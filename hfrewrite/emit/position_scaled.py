"""The source's statement scaling q per token by a function of the positions
(analyze/position_scale.py), rewritten onto vLLM's tensors: ``q`` is ``[tokens, heads *
head_dim]`` and ``positions`` is ``[tokens]``, so the function is called on the positions
as one sequence (``positions[None]``, the ``[batch, seq]`` it was written for) and its
factor is laid out one row per token (``.reshape(-1, 1)``, proven one number per token)."""

from __future__ import annotations

import libcst as cst

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.attention_body import config_switch
from hfrewrite.emit.fused_projection import unfreed
from hfrewrite.errors import HfrewriteError

_PASS = "vllm_attention"


def position_scaled(
    statement: cst.BaseStatement, params: set[str], cls: str, made: tuple[str, ...] = ()
) -> cst.BaseStatement:
    """``x = x * f(position_ids, ...)`` -> ``q = q * f(positions[None], ...).reshape(-1, 1)``;
    ``made``: (the factor's expression, the local naming the positions) where the forward
    makes its positions itself (analyze/position_function.py)."""
    if made:
        return _made_positions(statement, cls, *made)
    small = (
        statement.body[0]
        if isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1
        else None
    )
    target = small.targets[0].target if isinstance(small, cst.Assign) and len(small.targets) == 1 else None
    value = small.value if isinstance(small, cst.Assign) else None
    if not (
        isinstance(target, cst.Name)
        and isinstance(value, cst.BinaryOperation)
        and isinstance(value.operator, cst.Multiply)
    ):
        raise HfrewriteError(f"{cls}: {_PASS}: q's scale by position is not `q = q * factor`")
    q = target.value
    sides = [value.left, value.right]
    factor = next((x for x in sides if not _is_name(x, q)), None)
    if factor is None or sum(_is_name(x, q) for x in sides) != 1:
        raise HfrewriteError(f"{cls}: {_PASS}: q's scale by position is not `q = q * factor`")
    inputs = (t.plain_names(factor) & params) - {"self"}
    if len(inputs) != 1:
        raise HfrewriteError(f"{cls}: {_PASS}: q's scale reads {sorted(inputs)}, not the positions alone")
    (positions,) = inputs
    factor = t.replace_names(factor, {q: "q", positions: t.expr("positions[None]")})
    rows = cst.Call(cst.Attribute(factor, cst.Name("reshape")), [cst.Arg(t.expr("-1")), cst.Arg(t.expr("1"))])
    return t.stmt(f"q = q * {t.code(rows)}\n")


_MADE = """\
if {test}:
    # q scaled per token by the source's function of the positions (proven by replay on
    # far positions), on vLLM's positions: one number per token
    q = (q * ({factor}).reshape(-1, 1)).to(q.dtype)
"""


def _made_positions(statement: cst.BaseStatement, cls: str, expression: str, local: str) -> cst.BaseStatement:
    """The source's ``if <switch>:`` block making positions, a factor of them and q times
    it, as vLLM's: the factor's expression on vLLM's ``positions``."""
    test = config_switch(statement)
    if test is None:
        raise HfrewriteError(
            f"{cls}: {_PASS}: q's scale by positions it makes is not under one `if` of its own"
        )
    factor = t.replace_names(t.expr(expression), {local: t.expr("positions")})
    return t.stmt(_MADE.format(test=t.code(test), factor=t.code(factor)))


def same_line(line: str, statement: str) -> bool:
    """Whether the source ``line`` is in ``statement``'s text, whitespace aside, and the
    names fuse_qkv freed (``q`` -> ``q_states``: emit/fused_projection.py) as either."""
    return _plain(line) in _plain(statement)


def _plain(text: str) -> str:
    return unfreed(" ".join(text.split()))


def _is_name(node: cst.BaseExpression, name: str) -> bool:
    return isinstance(node, cst.Name) and node.value == name
