"""The output gates vLLM's attention files apply: one row per activation of the gate.

A gated attention multiplies the attention output by ``act(gate_proj(x))`` before the output
projection (AFMoE's sigmoid, Laguna's softplus), per lane (``[heads * head_dim]``) or per head
(``[heads]``). Each row is the plan's fact (``OutputGate.activation``), the reference the
analysis replays (``replay``) and the expression the file computes (``expression``, over the
name ``{gate}``). A new activation is one row here and its tests.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class GateActivation(enum.Enum):
    """(the name reports give it and a source's gate calls it by, the file's expression of
    ``{gate}``, the reference the analysis replays)."""

    SIGMOID = ("sigmoid", "torch.sigmoid({gate})", torch.sigmoid)
    SOFTPLUS = ("softplus", "torch.nn.functional.softplus({gate})", F.softplus)

    def __init__(
        self, label: str, expression: str, reference: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        self.label = label
        self.expression = expression
        self.reference = reference

    @property
    def calls(self) -> frozenset[str]:
        """The names a source's gate statement may call for this row."""
        return frozenset({self.label})

    def replay(self, gate: torch.Tensor) -> torch.Tensor:
        return self.reference(gate)


@dataclass(frozen=True)
class OutputGate:
    """The gate the analysis proved between the attention output and its projection."""

    attr: str  # the gate's Linear, reading the block's input as q, k and v do
    in_features: int
    out_features: int
    bias: bool
    activation: GateActivation
    per_head: bool  # one gate per head ([heads]), else one per lane ([heads * head_dim])
    upcast: bool  # the source computes the activation in float32 and casts back
    # the gate is the second half of each head of q's own projection, [heads, 2 * head_dim]
    # (Qwen3-Next's and Qwen3.5's): the fused q/k/v projection holds it, no Linear of its own
    packed: bool = False

    def describe(self) -> str:
        where = "per head" if self.per_head else "per lane"
        if self.packed:
            return f"attention output x {self.activation.label}(gate), the gate packed per head beside q in {self.attr}"
        return f"attention output x {self.activation.label}({self.attr}(x)), {where}"
