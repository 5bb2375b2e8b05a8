"""A position table held as a buffer of the base model itself (CTRL's sinusoidal
``pos_encoding``, indexed ``self.pos_encoding[position_ids, :]``), its rows added to the token
embeddings, which the source may first scale by a number it computes from the model
(``inputs_embeds *= np.sqrt(self.d_model_size)``).

Proven on the example run's values: the first layer receives ``scale * tokens +
table[offset : offset + seq]`` for exactly one buffer and one offset, every element checked.
Where the scale is not 1 it must be the value, on the built model, of the one factor the base
model's forward multiplies a name by before its layer loop, and that factor may read only
``self``, numbers and math libraries: the file writes the factor itself, so a config of
another width gets its own scale."""

from __future__ import annotations

import ast
import math

import numpy
import torch
from torch import nn

from hfrewrite.analyze.branches import method_tree
from hfrewrite.analyze.plan import PositionEmbeddingPlan
from hfrewrite.analyze.position_embedding import MAX_OFFSET  # as for learned tables

_LIBRARIES = {"np": numpy, "numpy": numpy, "math": math, "torch": torch}


def base_position_table(base: nn.Module, tokens, first) -> PositionEmbeddingPlan | None:
    """The plan when ``first`` (the first layer's input) is ``tokens`` (the embedding's
    output) scaled by one number plus the rows of one 2-d buffer of ``base`` at the
    positions; else None."""
    if not (torch.is_tensor(tokens) and torch.is_tensor(first) and tokens.shape == first.shape):
        return None
    found = [
        (name, offset, scale)
        for name, table in base.named_buffers(recurse=False)
        if table.dim() == 2 and table.is_floating_point() and table.shape[1] == tokens.shape[-1]
        for offset in range(MAX_OFFSET + 1)
        if (scale := _scale(tokens, first, table, offset)) is not None
    ]
    if len(found) != 1:
        return None
    name, offset, scale = found[0]
    factor = None
    if not math.isclose(scale, 1.0, rel_tol=1e-6):
        factor = _scale_factor(base, scale)
        if factor is None:
            return None
    return PositionEmbeddingPlan(attr="", offset=offset, module_call=False, table=name, token_scale=factor)


def _scale(tokens: torch.Tensor, first: torch.Tensor, table: torch.Tensor, offset: int) -> float | None:
    """The one number ``s`` with ``first == s * tokens + table[offset:offset + seq]``, else None."""
    seq = tokens.shape[-2]
    if offset + seq > table.shape[0]:
        return None
    rest = (first - table[offset : offset + seq].to(first.dtype)).double()
    scale = float((rest * tokens).sum() / (tokens.double() ** 2).sum())
    if not math.isfinite(scale) or scale == 0.0:
        return None
    return scale if torch.allclose(rest, scale * tokens.double(), rtol=1e-5, atol=1e-5) else None


def _scale_factor(base: nn.Module, scale: float) -> str | None:
    """The source text of the one factor the forward multiplies a name by (``x *= f``,
    ``x = x * f``, ``x = f * x``) before its layer loop whose value is ``scale``."""
    tree = method_tree(type(base), "forward")
    if tree is None:
        return None
    fits = {
        ast.unparse(factor)
        for factor in _factors(tree.body[0].body)
        if (got := _value_of(factor, base)) is not None and math.isclose(got, scale, rel_tol=1e-5)
    }
    return fits.pop() if len(fits) == 1 else None


def _factors(statements: list[ast.stmt]):
    """The factors a name is multiplied by in ``statements`` (and the ``if`` blocks among
    them), up to the first loop."""
    for s in statements:
        if isinstance(s, ast.For | ast.While):
            return
        if isinstance(s, ast.If):
            yield from _factors(s.body + s.orelse)
        if isinstance(s, ast.AugAssign) and isinstance(s.op, ast.Mult) and isinstance(s.target, ast.Name):
            yield s.value
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
            value = s.value
            if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult):
                name = s.targets[0].id
                sides = (value.left, value.right)
                yield from (b for a, b in (sides, sides[::-1]) if isinstance(a, ast.Name) and a.id == name)


def _value_of(factor: ast.expr, base: nn.Module) -> float | None:
    """``factor`` evaluated with ``self`` the base model, when it reads nothing else but
    numbers and math libraries."""
    names = {n.id for n in ast.walk(factor) if isinstance(n, ast.Name)}
    if not names <= {"self", *_LIBRARIES}:
        return None
    try:
        got = eval(compile(ast.Expression(factor), "<factor>", "eval"), {**_LIBRARIES, "self": base})
        return float(got)
    except Exception:  # noqa: BLE001 - not a number of the model: no proof
        return None
