"""A rope whose base no config field holds, read at load off the source's own rotary module.

TeleChat's rotary class computes its base (an NTK alpha from ``config.training_seqlen`` and
the head size). The replay (analyze/rope.py) proves that the source turns q and k by a
default neox rope of some base; this proves that one parameter-free child of the attention,
called as the file calls it, yields the table of that very rope: the file's helper
(``SOURCE_ROPE_THETA``, emit/position_code.py, run here as it is written there) reads the base
off the table. At load the same helper reads the real config's base off the source's module,
and raises unless the table is one default rope at every length up to the one vLLM serves.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hfrewrite.analyze.plan import RopeTable
from hfrewrite.analyze.trace import Traced
from hfrewrite.emit.position_code import SOURCE_ROPE_THETA

# the helper's base against the replay's (read off one angle): a looser match is another base
BASE_RTOL = 1e-4


def prove_rope_table(
    traced: Traced, path: str, base: float, rotary_dim: int, seq: int, length: int
) -> RopeTable | str:
    """The one child of the attention ``path`` whose table, built for ``length`` positions
    as the file builds it, is the default rope of ``base`` the replay proved (on a ``seq``
    long example), or why none is."""
    attention = traced.module.get_submodule(path)
    found, why = [], f"no child module of {type(attention).__name__} builds its table"
    for name, child in attention.named_children():
        called = traced.called_with.get(f"{path}.{name}" if path else name)
        if called is None or next(child.parameters(), None) is not None:
            continue
        call = _call_text(*called, seq)
        if call is None:
            why = f"{name} is called with arguments the file cannot rebuild"
            continue
        theta = _helper_theta(child, call, length, rotary_dim)
        if isinstance(theta, str):
            why = f"{name}: {theta}"
        elif math.isclose(theta, base, rel_tol=BASE_RTOL):
            found.append(RopeTable(name, call))
    return found[0] if len(found) == 1 else why


def _call_text(args: tuple, kwargs: dict, seq: int) -> str | None:
    """The call's arguments as source, each tensor a zero tensor of length ``n`` along its
    one dim of the example's length and 1 along the others (the helper's table then proves
    the module reads nothing else of it)."""
    parts = [_literal(a, seq) for a in args] + [
        None if (text := _literal(v, seq)) is None else f"{k}={text}" for k, v in kwargs.items()
    ]
    return None if None in parts else ", ".join(parts)


def _literal(x, seq: int) -> str | None:
    if isinstance(x, torch.Tensor):
        if list(x.shape).count(seq) != 1:
            return None
        dims = ", ".join("n" if d == seq else "1" for d in x.shape)
        return f"torch.zeros({dims}, dtype={x.dtype})"
    if isinstance(x, torch.dtype):
        return str(x)
    if x is None or isinstance(x, bool | int | float | str):
        return repr(x)
    return None


def _helper_theta(child: nn.Module, call: str, length: int, rotary_dim: int) -> float | str:
    """The base the file's helper reads off ``child``'s table, or why it raised."""
    scope: dict = {"torch": torch, "nn": nn, "math": math}
    exec(SOURCE_ROPE_THETA, scope)  # noqa: S102 - the helper exactly as the file defines it
    try:
        return scope["source_rope_theta"](
            child, eval(f"lambda rope, n: rope({call})", scope), length, rotary_dim
        )
    except Exception as e:  # noqa: BLE001 - the helper's refusal, or a call the module does not take
        return f"{type(e).__name__}: {e}"
