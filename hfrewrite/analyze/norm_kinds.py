"""The norms vLLM has a layer for: one row per kind.

Each row is the plan's fact (``NormPlan.kind``), the reference the analysis replays
(``reference``: the output for ``x``, ``eps`` and the weight; the offset is what the module
returns for a zero weight) and the vLLM class the file builds. A new norm is one row here
and its tests.
"""

from __future__ import annotations

import enum

import torch


class QkNormOrder(enum.Enum):
    """Where per-head q/k norms stand relative to the rotary embedding (their label in reports)."""

    BEFORE_ROPE = "before"  # qwen3: normalised, then turned
    AFTER_ROPE = "after"  # hunyuan: turned, then normalised


class NormKind(enum.Enum):
    """(how the weight scales the normalised x, the weight's offset, vLLM's class)."""

    RMS = ("weight", 0.0, "RMSNorm")  # llama's `weight * x`
    GEMMA_RMS = ("(1 + weight)", 1.0, "GemmaRMSNorm")  # gemma's `(1 + weight) * x`

    def __init__(self, scale: str, offset: float, vllm_class: str) -> None:
        self.scale = scale
        self.offset = offset
        self.vllm_class = vllm_class

    def reference(self, x: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
        """``x * rsqrt(mean(x**2) + eps) * (offset + weight)``."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (self.offset + weight)


def kind_of_offset(offset: float) -> NormKind | None:
    """The kind whose weight has this offset."""
    return next((kind for kind in NormKind if kind.offset == offset), None)


# what the analysis says when no row holds
KNOWN_FORMS = " or ".join(f"rms(x) * {kind.scale}" for kind in NormKind)
