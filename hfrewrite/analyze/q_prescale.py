"""q multiplied by a constant right after its projection, with the attention itself run at
scale 1 (OPT: ``self.q_proj(x) * self.scaling``, then ``scaling=1.0``, "to follow the
original implementation").

The product of the q projection's output by one Python number, which nothing but the
layout then reads, is the q path's start for the rest of the analysis; the attention's
scale is the call's times that number, and the file builds vLLM's ``Attention`` with the
source's own expression for it (``self.scaling``), read off the forward's line.
"""

from __future__ import annotations

import ast
import math
import operator

from torch.fx import Node

from hfrewrite.analyze.fused_qkv import forward_code, source_line
from hfrewrite.analyze.trace import Traced

MUL = (operator.mul, "mul")


def peel_q_prescale(traced: Traced, path: str, feeder: Node) -> tuple[Node, float, str] | None:
    """(the scaled node, the number, the source's expression for it) when the q
    projection ``feeder`` is read only by ``feeder * number``; else None."""
    users = list(feeder.users)
    if len(users) != 1:
        return None
    (scaled,) = users
    if scaled.op not in ("call_function", "call_method") or scaled.target not in MUL or len(scaled.args) != 2:
        return None
    if feeder not in scaled.args:
        return None
    proven = factor_of(
        scaled, source_line(scaled, forward_code(traced, path)), traced.module.get_submodule(path)
    )
    return None if proven is None else (scaled, *proven)


def factor_of(product: Node, line: str, module) -> tuple[float, str] | None:
    """(the number, the source's expression for it) of ``product``, a product by one Python
    number traced off ``line``, when that line multiplies by one expression reading ``self``
    alone that gives the number on ``module``; else None."""
    numbers = [a for a in product.args if isinstance(a, int | float) and not isinstance(a, bool)]
    if len(numbers) != 1:
        return None
    expression, number = _factor_text(line), float(numbers[0])
    if not expression or not _evaluates_to(expression, module, number):
        return None
    return number, expression


def _evaluates_to(expression: str, module, number: float) -> bool:
    """The source's expression (reading ``self`` alone) gives the traced number on the module."""
    try:
        got = eval(compile(expression, "<factor>", "eval"), {"__builtins__": {}}, {"self": module})
    except Exception:  # noqa: BLE001 - an expression the module cannot answer: unproven
        return False
    return isinstance(got, int | float) and math.isclose(float(got), number, rel_tol=1e-12)


def _factor_text(line: str) -> str:
    """``self.scaling`` of ``x = self.q_proj(h) * self.scaling`` (a whole statement on one
    line; the factor reads ``self`` alone, so ``__init__`` can read it too), else ""."""
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return ""
    products = [n for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult)]
    if len(products) != 1:
        return ""
    sides = [products[0].left, products[0].right]
    calls = [s for s in sides if isinstance(s, ast.Call)]
    others = [s for s in sides if not isinstance(s, ast.Call)]
    if len(calls) != 1 or len(others) != 1:
        return ""
    names = {n.id for n in ast.walk(others[0]) if isinstance(n, ast.Name)}
    return ast.unparse(others[0]) if names <= {"self"} else ""
