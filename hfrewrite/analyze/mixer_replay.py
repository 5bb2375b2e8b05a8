"""Replaying a hybrid model's other mixer: the block, run on a random input, against the
formula of the vLLM layer it would become."""

from __future__ import annotations

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
    if not (torch.is_tensor(got) and got.shape == want.shape):
        return None
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def random_input(module: nn.Module, batch: int, tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    """Hidden states [batch, tokens, width] in the block's dtype, the same for a seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, tokens, width, generator=generator, dtype=next(module.parameters()).dtype)


def block_output(module: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """The block's output on ``hidden`` alone; None where it needs more than its hidden states."""
    with torch.no_grad():
        try:
            got = module(hidden)
        except Exception:  # noqa: BLE001 - a block that needs more than its hidden states
            return None
    return got[0] if isinstance(got, tuple) else got
