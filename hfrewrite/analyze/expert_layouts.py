"""How stacked experts hold their weights: one row per layout (``MoePlan.experts_layout``).

Experts stacked as ``gate_up_proj`` / ``down_proj`` tensors (transformers 5's experts modules)
hold gate and up as halves of ``2I`` or interleaved along it (gpt_oss), and ``[E, 2I, H]``
(vLLM's own ``w13`` layout) or transposed ``[E, H, 2I]`` (gpt_oss). Each row is the plan's
fact, the weights the replay reads (``weights``: per expert gate, up and down) and what the
file does at load (``needs_split``: the runner's loader reads only the first row's layout;
``split``/``transposed``: the expressions of the emitted ``_experts_one_by_one``). The replay
proves a row by trying each; a new layout is one row and its tests.
"""

from __future__ import annotations

import enum

import torch
from torch import nn


class ExpertLayout(enum.Enum):
    """(how reports describe it, transposed, gate and up interleaved)."""

    HALVES = ("[gate; up]", False, False)
    INTERLEAVED = ("[gate, up interleaved]", False, True)
    TRANSPOSED = ("[gate; up], transposed", True, False)
    TRANSPOSED_INTERLEAVED = ("[gate, up interleaved], transposed", True, True)  # gpt_oss

    def __init__(self, label: str, transposed: bool, interleaved: bool) -> None:
        self.label = label
        self.transposed = transposed
        self.interleaved = interleaved

    @classmethod
    def of(cls, transposed: bool, interleaved: bool) -> ExpertLayout:
        return next(row for row in cls if (row.transposed, row.interleaved) == (transposed, interleaved))

    @property
    def needs_split(self) -> bool:
        """vLLM's fused-MoE loader reads ``[E, 2I, H]`` halves alone: the others load one by one."""
        return self is not ExpertLayout.HALVES

    @property
    def shapes(self) -> str:
        """The tensors' shapes, for the emitted loader's docstring."""
        if self.transposed:
            return "gate_up_proj [E, H, 2I], down_proj [E, I, H]"
        return "gate_up_proj [E, 2I, H]"

    @property
    def split(self) -> str:
        """The emitted loader's expression taking one expert's ``rows`` into gate and up."""
        return "rows[0::2], rows[1::2]" if self.interleaved else "rows.chunk(2, dim=0)"

    def weights(self, experts: nn.Module) -> tuple[list, list, list, list]:
        """Per expert gate, up [I, H], down [H, I] weights and (gate, up, down) biases or
        Nones, from ``experts.gate_up_proj`` / ``down_proj`` (and their ``_bias``) as this
        layout holds them."""
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if self.transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        bias = getattr(experts, "gate_up_proj_bias", None)
        down_bias = getattr(experts, "down_proj_bias", None)
        gate, up = self._halves(gate_up)
        biases = [None] * len(gate)
        if bias is not None and down_bias is not None:
            gate_b, up_b = self._halves(bias)
            biases = list(zip(gate_b, up_b, down_bias))
        return list(gate), list(up), list(down), biases

    def _halves(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gate and up of ``t`` along its dim 1 (the ``2I`` one)."""
        n = t.shape[1]
        if self.interleaved:
            return t.index_select(1, torch.arange(0, n, 2)), t.index_select(1, torch.arange(1, n, 2))
        return t.narrow(1, 0, n // 2), t.narrow(1, n // 2, n // 2)
