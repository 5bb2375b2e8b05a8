"""Expressions that only compute a value: what a pass may drop or skip when unread."""

from __future__ import annotations

import libcst as cst

from hfrewrite.emit.cst_tools import call_name, code


def computes_only(node: cst.BaseExpression, pure_calls: frozenset[str] = frozenset()) -> bool:
    """``node`` only computes a value: names, attributes, constants, arithmetic, comparisons,
    ``and``/``or``, conditional expressions, subscripts, tuples, and calls of ``pure_calls``; dropping or skipping it changes nothing else."""
    if isinstance(node, (cst.Name, cst.BaseNumber, cst.SimpleString)):
        return True
    if isinstance(node, cst.Attribute):
        return computes_only(node.value, pure_calls)
    if isinstance(node, cst.BinaryOperation):
        return computes_only(node.left, pure_calls) and computes_only(node.right, pure_calls)
    if isinstance(node, cst.UnaryOperation):
        return computes_only(node.expression, pure_calls)
    if isinstance(node, cst.BooleanOperation):
        return computes_only(node.left, pure_calls) and computes_only(node.right, pure_calls)
    if isinstance(node, cst.Comparison):
        return computes_only(node.left, pure_calls) and all(
            computes_only(c.comparator, pure_calls) for c in node.comparisons
        )
    if isinstance(node, cst.IfExp):
        return all(computes_only(x, pure_calls) for x in (node.test, node.body, node.orelse))
    if isinstance(node, cst.Tuple):
        return all(computes_only(e.value, pure_calls) for e in node.elements)
    if isinstance(node, cst.Subscript):
        return computes_only(node.value, pure_calls) and all(
            isinstance(e.slice, cst.Index) and computes_only(e.slice.value, pure_calls) for e in node.slice
        )
    if isinstance(node, cst.Call):
        # a conversion of a value computed here (`torch.arange(0, d, 2).float()`): never a module's
        receiver = node.func.value if isinstance(node.func, cst.Attribute) else None
        pure = (
            call_name(node) in pure_calls
            or (
                isinstance(receiver, cst.Call)
                and node.func.attr.value in _CONVERSIONS
                and computes_only(receiver, pure_calls)
            )
            # a read of the config's dicts (`config.rope_parameters.get("partial_rotary_factor")`)
            or (receiver is not None and node.func.attr.value == "get" and _config_field(receiver))
        )
        return pure and all(computes_only(a.value, pure_calls) for a in node.args)
    return False


def computed_local(statement: cst.BaseStatement, pure_calls: frozenset[str] = frozenset()) -> str | None:
    """The name ``statement`` binds when it is ``name = <value that only computes>``."""
    if not (isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1):
        return None
    small = statement.body[0]
    if not (isinstance(small, cst.Assign) and len(small.targets) == 1):
        return None
    target = small.targets[0].target
    if isinstance(target, cst.Name) and computes_only(small.value, pure_calls):
        return target.value
    return None


_CONVERSIONS = frozenset({"float", "double", "half", "int", "long"})


def _config_field(node: cst.BaseExpression | None) -> bool:
    """``config.<field>`` or ``self.config.<field>``."""
    if not isinstance(node, cst.Attribute):
        return False
    root = node.value
    return code(root) in ("config", "self.config")
