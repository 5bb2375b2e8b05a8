"""A statement that only lays a tensor out anew, its lanes in the same order."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

# methods that only lay a tensor out anew (its lanes in the same order)
_RELAYOUT = {"view", "reshape", "transpose", "permute", "contiguous", "unflatten", "flatten"}


def relayout(statement: cst.BaseStatement, var: str) -> bool:
    """``<var> = <var>.reshape(...).transpose(...)``: layout methods alone, on ``<var>``."""
    if not (
        m.matches(statement, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name(var))])]))
    ):
        return False
    node = statement.body[0].value
    while isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
        if node.func.attr.value not in _RELAYOUT:
            return False
        node = node.func.value
    return m.matches(node, m.Name(var)) and node is not statement.body[0].value
