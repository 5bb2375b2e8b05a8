"""How the source calls its attention: one row per kind (``AttentionPlan.attention_call``).

Each row is what reports call it and the softmax scale the file gives vLLM's ``Attention``
where the source's call names none (None: the call's own ``scaling=``).
"""

from __future__ import annotations

import enum


class AttentionCall(enum.Enum):
    """(the name reports give it, the scale the file passes where the call names none)."""

    INTERFACE = ("attention interface", None)  # attention_interface(..., scaling=...)
    # torch's scaled_dot_product_attention called directly, or attention written out by hand,
    # proven causal self-attention (trace.causal_sdpa) at torch's default scale ...
    CAUSAL_SDPA = ("torch SDPA or attention by hand (proven causal)", "self.head_dim**-0.5")
    # ... or with its scores not scaled at all (GPT-Neo)
    CAUSAL_SDPA_UNSCALED = ("torch SDPA or attention by hand (proven causal)", "1.0")

    def __init__(self, label: str, scaling: str | None) -> None:
        self.label = label
        self.scaling = scaling

    @property
    def direct(self) -> bool:
        """Not through transformers' interface: the file computes what the source's call did."""
        return self is not AttentionCall.INTERFACE
