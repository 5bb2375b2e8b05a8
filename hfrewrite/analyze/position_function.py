"""A per-token factor the forward computes from positions it makes itself (Llama-4's
attention temperature: ``positions = torch.arange(seq) + past_seen_tokens``, then
``log1p(floor((positions + 1) / floor_scale)) * attn_scale + 1``).

On the example run (no cache) those positions are the tokens' positions, 0..seq-1: what
vLLM's ``positions`` holds for each token. The factor is one assignment of the forward,
``name = <expression>``, computed elementwise from them; the file evaluates that
expression on vLLM's positions. It is proven by replay: the traced graph from the positions
to the factor, run on far positions (where the temperature departs from 1), against the
expression evaluated with the module's own attributes.
"""

from __future__ import annotations

import ast
import inspect
import operator
import textwrap
from typing import NamedTuple

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from hfrewrite.analyze.dataflow import ancestors
from hfrewrite.analyze.trace import value

# elementwise ops the factor may be computed by from the positions
_POINTWISE = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.neg,
    torch.add, torch.sub, torch.mul, torch.div, torch.floor, torch.log, torch.log1p, torch.exp,
    torch.sqrt, torch.rsqrt, torch.clamp, torch.minimum, torch.maximum, torch.pow,
    "add", "sub", "mul", "div", "float", "to", "floor", "log", "log1p", "exp", "sqrt", "clamp",
    "pow", "type_as",
}  # fmt: skip
# far positions the replay checks the expression at (Llama-4's floor_scale is 8192)
_FAR = (0, 1, 8191, 8192, 16384, 65535, 100_000, 1_000_000, 3_000_000)


class PositionFunction(NamedTuple):
    """The forward's expression of the factor, the local naming its positions, their count."""

    expression: str
    positions: str
    seq: int


def position_function(factor_value: Node, code, module) -> PositionFunction | str:
    """The factor (``factor_value``: its last value-computing node, before any layout) as the
    forward's expression of the positions it makes with ``arange``; else why not. ``code``:
    the forward's code object, ``module``: the attention module (its attributes)."""
    made = [n for n in ancestors(factor_value, None) if n.op == "call_function" and n.target is torch.arange]
    if len(made) != 1:
        return "its factor is not computed from one arange of positions"
    start = _positions(made[0], factor_value)
    seq = value(start).numel()
    if not torch.equal(value(start).flatten(), torch.arange(seq)):
        return "its positions are not the tokens' 0..seq-1 on the example run"
    steps = [n for n in ancestors(factor_value, None) if start in ancestors(n, None) and n is not start]
    if any(n.target not in _POINTWISE for n in steps) or any(
        _reads_tensor(n, {start, *steps}) for n in steps
    ):
        return "its factor is not computed elementwise from the positions alone"
    statements = _statements(code)
    bound = _assignment(statements, start, code)
    computed = _assignment(statements, factor_value, code)
    if bound is None or computed is None or not isinstance(bound.targets[0], ast.Name):
        return "the positions or the factor are not one assignment of the forward"
    function = PositionFunction(ast.unparse(computed.value), bound.targets[0].id, seq)
    free = {n.id for n in ast.walk(computed.value) if isinstance(n, ast.Name)}
    if free - {function.positions, "self", "torch"}:
        return f"the factor's expression reads {sorted(free - {function.positions, 'self', 'torch'})}"
    return (
        function
        if _replays(function, start, factor_value, steps, module)
        else "the forward's expression of the factor does not replay its traced values"
    )


def _positions(made: Node, factor_value: Node) -> Node:
    """The last node from ``made`` on still holding the positions 0..seq-1 as integers (the
    ``+ past_seen_tokens`` of a run without a cache)."""
    order = {n: i for i, n in enumerate(made.graph.nodes)}
    held = [
        n
        for n in ancestors(factor_value, None)
        if made in ancestors(n, None)
        and torch.is_tensor(value(n))
        and not value(n).is_floating_point()
        and torch.equal(value(n), value(made))
    ]
    return max(held, key=order.__getitem__, default=made)


def _reads_tensor(node: Node, computed: set[Node]) -> bool:
    """``node`` reads a tensor of more than one number besides the positions' values."""
    return any(
        n not in computed and torch.is_tensor(value(n)) and value(n).numel() > 1 for n in node.all_input_nodes
    )


def _statements(code) -> list[ast.stmt]:
    source = textwrap.dedent(inspect.getsource(code))
    return [s for s in ast.walk(ast.parse(source)) if isinstance(s, ast.Assign)]


def _assignment(statements: list[ast.stmt], node: Node, code) -> ast.Assign | None:
    """The one-target assignment of the forward whose lines hold ``node``'s traced line."""
    lineno = node.meta.get("lines", {}).get(code)
    if lineno is None:
        return None
    line = lineno - code.co_firstlineno + 1
    found = [s for s in statements if len(s.targets) == 1 and s.lineno <= line <= s.end_lineno]
    return found[0] if len(found) == 1 else None


def _replays(function: PositionFunction, start: Node, end: Node, steps: list[Node], module) -> bool:
    """The traced steps from the positions to the factor, and the expression, agree on far
    positions as well as on the example's."""
    expression = compile(function.expression, "<factor>", "eval")
    order = {n: i for i, n in enumerate(end.graph.nodes)}
    traced = value(start)
    for far in (_FAR[i : i + traced.numel()] for i in range(0, len(_FAR), traced.numel())):
        padded = list(far) + [0] * (traced.numel() - len(far))
        positions = torch.tensor(padded, dtype=traced.dtype).reshape(traced.shape)
        env = {start: positions}
        for node in sorted(steps, key=order.__getitem__):
            env[node] = run_node(node, env)
        got = eval(expression, {"torch": torch}, {"self": module, function.positions: positions})
        if not (torch.is_tensor(got) and got.shape == env[end].shape and torch.allclose(got, env[end])):
            return False
    return True


def run_node(node: Node, env: dict[Node, object]):
    """``node`` on the replayed values of its inputs (the traced value of any other)."""
    args = map_arg(node.args, lambda n: env.get(n, value(n)))
    kwargs = map_arg(node.kwargs, lambda n: env.get(n, value(n)))
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)
