"""The router scorings vLLM's fused MoE computes: one row per scoring (``MoePlan.scoring``).

Each row is the plan's fact, the reference the analysis replays (``reference``: the scores
of the router's logits, in ``routing.route``), the traced calls that compute it (``calls``)
and what the file passes vLLM (``FusedMoE(scoring_func=row.vllm_name)``; None: vLLM's
default, softmax). A new scoring is one row here and its tests.
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F


class Scoring(enum.Enum):
    """(the name reports give it, vLLM's ``scoring_func`` where it is not the default)."""

    SOFTMAX = ("softmax", None)
    SIGMOID = ("sigmoid", "sigmoid")  # vLLM's CPU router computes it on its grouped path only
    # the source's own router runs, handed to the experts as a custom routing function
    CARRIED = ("carried", None)

    def __init__(self, label: str, vllm_name: str | None) -> None:
        self.label = label
        self.vllm_name = vllm_name

    def reference(self, logits: torch.Tensor) -> torch.Tensor:
        """The scores vLLM computes from the router's ``logits`` (float32)."""
        if self is Scoring.SOFTMAX:
            return torch.softmax(logits, dim=-1)
        if self is Scoring.SIGMOID:
            return logits.sigmoid()
        raise ValueError("a carried router computes its own scores")

    @property
    def calls(self) -> tuple:
        """The traced targets (functions, or method names) computing this scoring."""
        return _CALLS.get(self, ())


_CALLS = {
    Scoring.SOFTMAX: (F.softmax, torch.softmax, "softmax"),
    Scoring.SIGMOID: (torch.sigmoid, F.sigmoid, "sigmoid"),
}


def scoring_computed_by(target) -> Scoring | None:
    """The scoring a traced call's ``target`` computes, if it is one."""
    return next((s for s in _CALLS if target in s.calls), None)
