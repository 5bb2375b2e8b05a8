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
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, tokens, width, generator=generator, dtype=next(module.parameters()).dtype)
    with torch.no_grad():
        try:
            got = module(hidden)
        except Exception:  # noqa: BLE001 - a block that needs more than its hidden states
            return None
        got = got[0] if isinstance(got, tuple) else got
        want = formula(hidden)
    if not (torch.is_tensor(got) and got.shape == want.shape):
        return None
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
