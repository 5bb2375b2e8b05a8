"""A per-token scale of q computed from the positions alone, after the rope (Llama-4's
attention temperature in ministral3: ``q * get_llama_4_attn_scale(position_ids, beta, n)``).

The attention's q input is ``x * factor`` (either order, the factor maybe cast), where the
factor's value flows from the integer positions the layer is given and from nothing the
projection computes, and holds one number per token: size 1 along the heads and the lanes
of q. The rest of the analysis (rope, norms, layouts) then runs on ``x``; the file keeps the
source's statement after vLLM's rope, its function called on vLLM's positions as one
sequence (``positions[None]``) and its factor laid out one row per token.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from hfrewrite.analyze.dataflow import ancestors, reaches
from hfrewrite.analyze.fused_qkv import forward_code, source_line
from hfrewrite.analyze.position_function import position_function, run_node
from hfrewrite.analyze.trace import Traced, value

_MULS = (operator.mul, torch.mul, "mul")


def peel_position_scale(traced: Traced, path: str, scope: set[Node], q: Node, feeder: Node):
    """(``x``, the scale's fact) when ``q`` is ``x`` scaled per token by a factor of the
    positions alone; else (``q``, None). The fact: (the forward's source line applying the
    scale,), or with the factor's expression and the local naming the positions where the
    forward makes them itself (analyze/position_function.py). Behind layout and casts (Llama-4
    transposes q after scaling it) the scaled value is taken out of the traced graph: q is
    then read as computed from ``x``, the values along the way recomputed."""
    chain, mul = _behind_layout(q)
    if not (isinstance(mul, Node) and mul.op in ("call_function", "call_method") and mul.target in _MULS):
        return q, None
    if any(len(n.users) != 1 for n in [mul, *chain[1:]]):
        return q, None  # the scaled q read elsewhere too: taking the scale out would change that
    operands = [a for a in mul.args if isinstance(a, Node)]
    if len(operands) != 2 or len(mul.args) != 2:
        return q, None
    code = forward_code(traced, path)
    for x, factor in (operands, operands[::-1]):
        if not _from_x(x, factor, feeder, scope):
            continue
        line = source_line(mul, code)
        found = _positions_given(factor) or _positions_made(factor, code, traced.module.get_submodule(path))
        if not line or found is None or not _per_token(x, factor, found[1]):
            continue
        fact = found[0]
        if not chain:
            return x, (line, *fact)
        _without(mul, x, chain)
        return q, (line, *fact)
    return q, None


# what may stand between the scaled q and the attention's input, or a factor and its values
_LAYOUT = ("transpose", "to", "contiguous", "view", "reshape", "expand", "unsqueeze", "float")


def _behind_layout(node: Node) -> tuple[list[Node], Node]:
    """(the layout steps, last first, leading to ``node``; the node they start from)."""
    chain = []
    while isinstance(node, Node) and node.op == "call_method" and node.target in _LAYOUT:
        chain.append(node)
        node = node.args[0]
    return chain, node


def _without(mul: Node, x: Node, chain: list[Node]) -> None:
    """The layout steps after ``mul`` read ``x`` instead; their values recomputed."""
    chain[-1].replace_input_with(mul, x)
    for node in reversed(chain):
        node.meta["value"] = run_node(node, {})


def _from_x(x: Node, factor: Node, feeder: Node, scope: set[Node]) -> bool:
    """``x`` is computed from the projection, ``factor`` from none of its values."""
    if not (torch.is_tensor(value(x)) and torch.is_tensor(value(factor))):
        return False
    return reaches(feeder, x, scope | {feeder}) and feeder not in ancestors(factor, None)


def _per_token(x: Node, factor: Node, seq: int) -> bool:
    """One number per (batch, token): q is [b, h, s, d] or [b, s, h, d]; the factor is 1
    on h and d."""
    xv, fv = value(x), value(factor)
    if xv.dim() != 4 or fv.dim() != 4:
        return False
    token_axis = next((i for i in (1, 2) if xv.shape[i] == seq and fv.shape[i] in (1, seq)), None)
    if token_axis is None or fv.shape[-1] != 1 or fv.shape[3 - token_axis] != 1:
        return False
    return fv.shape[0] in (1, xv.shape[0])


def _positions_given(factor: Node) -> tuple | None:
    """((), the sequence's length) where the factor flows from the one integer ``[batch,
    seq]`` input the layer is given (its positions); else None."""
    inputs = [n for n in ancestors(factor, None) if n.op == "placeholder"]
    if len(inputs) != 1 or not torch.is_tensor(value(inputs[0])):
        return None
    positions = value(inputs[0])
    if positions.is_floating_point() or positions.dim() != 2:
        return None
    return (), positions.shape[1]


def _positions_made(factor: Node, code, module) -> tuple | None:
    """((the factor's expression, the positions' local), the sequence's length) where the
    forward makes the positions itself, proven by replay; else None."""
    _, factor_value = _behind_layout(factor)
    found = position_function(factor_value, code, module)
    return None if isinstance(found, str) else (tuple(found[:2]), found.seq)
