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
from hfrewrite.analyze.trace import Traced, value

_MULS = (operator.mul, torch.mul, "mul")


def peel_position_scale(traced: Traced, path: str, scope: set[Node], q: Node, feeder: Node):
    """(``x``, the forward's source line applying the scale) when ``q`` is ``x`` scaled per
    token by a factor of the positions alone; else (``q``, None)."""
    if not (isinstance(q, Node) and q.op in ("call_function", "call_method") and q.target in _MULS):
        return q, None
    operands = [a for a in q.args if isinstance(a, Node)]
    if len(operands) != 2 or len(q.args) != 2:
        return q, None
    for x, factor in (operands, operands[::-1]):
        if _per_token_positions_only(x, factor, feeder, scope):
            line = source_line(q, forward_code(traced, path))
            return (x, line) if line else (q, None)
    return q, None


def _per_token_positions_only(x: Node, factor: Node, feeder: Node, scope: set[Node]) -> bool:
    xv, fv = value(x), value(factor)
    if not (torch.is_tensor(xv) and torch.is_tensor(fv)) or xv.dim() != 4 or fv.dim() != 4:
        return False
    if not reaches(feeder, x, scope | {feeder}) or feeder in ancestors(factor, None):
        return False
    inputs = [n for n in ancestors(factor, None) if n.op == "placeholder"]
    if len(inputs) != 1 or not torch.is_tensor(value(inputs[0])):
        return False
    positions = value(inputs[0])
    if positions.is_floating_point() or positions.dim() != 2:
        return False
    # one number per (batch, token): q is [b, h, s, d] or [b, s, h, d]; the factor is 1 on h and d
    seq = positions.shape[1]
    token_axis = next((i for i in (1, 2) if xv.shape[i] == seq and fv.shape[i] in (1, seq)), None)
    if token_axis is None or fv.shape[-1] != 1 or fv.shape[3 - token_axis] != 1:
        return False
    return fv.shape[0] in (1, xv.shape[0])
