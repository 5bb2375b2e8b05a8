"""The rope styles vLLM computes: one row per way of pairing a head's lanes.

Each row is the plan's fact (``AttentionPlan.rope_style``, ``MlaPlan.rope_style``), the
reference the analysis replays (``rotate``: the turned lanes from cos and sin) and what the
file passes vLLM (``get_rope(..., is_neox_style=row.is_neox)``). A new style is one row here
and its tests.
"""

from __future__ import annotations

import enum

import torch


class RopeStyle(enum.Enum):
    """(the name reports give it, vLLM's ``is_neox_style``)."""

    NEOX = ("neox", True)  # the first half of the lanes pairs with the second
    GPTJ = ("GPT-J (interleaved)", False)  # even lanes pair with odd ones

    def __init__(self, label: str, is_neox: bool) -> None:
        self.label = label
        self.is_neox = is_neox

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x``'s lanes (as many as ``2 * cos.shape[-1]``) turned by the angles of ``cos``/``sin``."""
        rot = x.shape[-1]
        if self is RopeStyle.NEOX:
            x1, x2 = x[..., : rot // 2], x[..., rot // 2 :]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


class RopeLayers(enum.Enum):
    """Which layers turn q and k (``AttentionPlan.rope_layers``): the file builds its rope, and
    calls it under the source's own condition where only some layers do (NoPE)."""

    NONE = "none"  # positions come another way (ALiBi, or added to the embeddings)
    ALL = "all"
    SOME = "some"  # the others apply none (cohere2's global layers)


class RopeTurn(enum.Enum):
    """Which way the rope turns (``AttentionPlan.rope_turn``): (what the file builds, how it
    turns in reports, the vLLM name the file imports for it, the sign of the angle the
    replay applies)."""

    FORWARD = ("get_rope", "", "get_rope", 1.0)
    # nanochat turns by -theta: vLLM's RotaryEmbedding with its sin table negated (the
    # template's ReversedRotaryEmbedding, templates/rope.py)
    REVERSED = ("ReversedRotaryEmbedding", "turning by -theta, ", "RotaryEmbedding", -1.0)

    def __init__(self, builds: str, how: str, vllm_import: str, sign: float) -> None:
        self.builds = builds
        self.how = how
        self.vllm_import = vllm_import
        self.sign = sign
