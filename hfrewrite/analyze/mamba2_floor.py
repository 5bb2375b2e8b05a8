"""A Mamba-2 block's time-step limits: the ``(low, high)`` pair of floats its ``__init__`` builds
from the config (``time_step_limit``), which the block's scan applies after the softplus,
``dt = clamp(softplus(dt + dt_bias), low, high)``. vLLM's ``MambaMixer2`` applies none.

``(0, inf)`` is no limit: the file checks that the config keeps it so. A floor above 0 with no
ceiling (NemotronH's ``(config.time_step_min, float("inf"))``) is kept by the file's mixer
(templates/mamba2.py ``FlooredMambaMixer2``): softplus is increasing, so flooring its input at
``softplus^-1(low) - dt_bias`` floors its output at ``low``. The floor is proven by replay with
the block's ``dt_bias`` lowered until every time step falls below it: the block must equal the
formula with the floor and differ from it without. A ceiling is refused.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hfrewrite.analyze.mixer_replay import replay_difference

CLAMP = "vLLM's MambaMixer2 does not clamp time steps"
_LOWERED = 20.0  # dt_bias lowered by this much: softplus(x - 20) is below any floor in use
_TOLERANCE = 1e-4
_SHOWN = 1e-3  # the floor must change the replay by more than this to count as seen


@dataclass(frozen=True)
class TimeStepLimits:
    """What the file does about the block's limits."""

    conditions: tuple[tuple[str, str], ...]  # (condition, why) the config must meet
    floor: str = ""  # the config expression of the floor ("": the block has none)
    floor_value: float = 0.0  # its value on the traced config


def time_step_limits(expressions: list[tuple[str, str, object]]) -> TimeStepLimits | str:
    """The limits among the block's ``__init__`` expressions ((attribute, code, value), see
    mamba2.init_expressions); a str: why the file cannot keep them."""
    pairs = [
        (code, tuple(value))
        for _, code, value in expressions
        if isinstance(value, tuple | list) and len(value) == 2 and all(type(v) is float for v in value)
    ]
    conditions, floor, floor_value = [], "", 0.0
    for code, (low, high) in pairs:
        if (low, high) == (0.0, math.inf):
            conditions.append((f'tuple({code}) == (0.0, float("inf"))', CLAMP))
            continue
        if high != math.inf or low <= 0.0 or floor:
            return f"{code} is {(low, high)}: {CLAMP} (the file keeps one floor above 0, no ceiling)"
        low_code, high_code = _parts(code)
        if "config" in {n.id for n in ast.walk(ast.parse(high_code, mode="eval")) if isinstance(n, ast.Name)}:
            conditions.append((f'{high_code} == float("inf")', "the file floors time steps, it caps none"))
        floor, floor_value = low_code, low
    return TimeStepLimits(tuple(conditions), floor, floor_value)


def _parts(code: str) -> tuple[str, str]:
    """The expressions of a pair's two values: a tuple's elements, else its subscripts."""
    tree = ast.parse(code, mode="eval").body
    if isinstance(tree, ast.Tuple) and len(tree.elts) == 2:
        return ast.unparse(tree.elts[0]), ast.unparse(tree.elts[1])
    return f"{code}[0]", f"{code}[1]"


def floor_replay(
    module: nn.Module,
    width: int,
    tokens: int,
    formula: Callable[[torch.Tensor, float], torch.Tensor],
    floor: float,
) -> str | None:
    """Why the block's floor is not proven (None: it is): with its ``dt_bias`` lowered (and
    ``D`` at 0), the block must replay ``formula`` (hidden, floor) with the floor, and differ
    from it without."""
    kept = module.dt_bias.data.clone(), module.D.data.clone()
    try:
        module.dt_bias.data -= _LOWERED
        module.D.data.zero_()  # the output is the scan's alone, which the time steps scale
        floored = replay_difference(module, width, tokens, lambda h: formula(h, floor))
        unfloored = replay_difference(module, width, tokens, lambda h: formula(h, 0.0))
    finally:
        module.dt_bias.data.copy_(kept[0])
        module.D.data.copy_(kept[1])
    if floored is None or floored > _TOLERANCE:
        shown = "fails" if floored is None else f"differs by {floored:.2e}"
        return f"with its time steps below the floor {floor}, replaying vLLM's Mamba-2 mixer with the floor {shown}"
    if unfloored is None or unfloored <= _SHOWN:
        return f"the replay cannot tell its time-step floor {floor} from none"
    return None
