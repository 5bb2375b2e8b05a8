"""Replaying a hybrid model's other mixer: the block, run on a random input, against the
formula of the vLLM layer it would become."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn


def replay_difference(
    module: nn.Module, width: int, tokens: int, formula: Callable[[torch.Tensor], torch.Tensor]
) -> float | None:
    """The largest difference, relative to the largest value, between ``module`` and
    ``formula`` on one random input [2, tokens, width]; None where the block does not run
    on its hidden states alone or returns another shape."""
    hidden = random_input(module, 2, tokens, width)
    got = block_output(module, hidden)
    if got is None:
        return None
    with torch.no_grad():
        want = formula(hidden)
    return relative_difference(got, want)


def relative_difference(got: torch.Tensor | None, want: torch.Tensor) -> float | None:
    """The largest difference between ``got`` and ``want``, relative to the largest value of
    ``want``; None where ``got`` is not a tensor of its shape."""
    if not (torch.is_tensor(got) and got.shape == want.shape):
        return None
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def random_input(module: nn.Module, batch: int, tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    """Hidden states [batch, tokens, width] in the block's dtype, the same for a seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, tokens, width, generator=generator, dtype=next(module.parameters()).dtype)


def block_output(
    module: nn.Module, hidden: torch.Tensor, none_for_required: bool = False
) -> torch.Tensor | None:
    """The block's output on ``hidden`` alone; None where it needs more than its hidden states.
    With ``none_for_required``, every other parameter its forward requires is given None (no
    rotary tables, no mask, no cache: MiniMax's lightning attention, a prefill from a zero
    state)."""
    rest = []
    if none_for_required:
        required = [
            p
            for p in inspect.signature(module.forward).parameters.values()
            if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD
        ]
        rest = [None] * (len(required) - 1)
    with torch.no_grad():
        try:
            got = module(hidden, *rest)
        except Exception:  # noqa: BLE001 - a block that needs more than its hidden states
            return None
    return got[0] if isinstance(got, tuple) else got
