"""Which KV cache a proven latent attention gets in vLLM 0.32: one row per kind.

vLLM allocates a latent (MLA) cache, ``[kv_lora_rank + rope]`` per token, only for the model
types it lists (``ModelArchConfigConvertorBase.is_deepseek_mla``); for any other type it sizes
a per-head cache, where its ``MLAAttention`` cannot run. There the file expands the latent
into per-head k and v and runs vLLM's ``Attention``, as vLLM's own ``minicpm3.py`` does: the
same computation (the analysis replays it), a larger cache.
"""

from __future__ import annotations

import enum

# tests/analyze/test_mla.py checks the list against the installed vLLM.
VLLM_MLA_TYPES = frozenset(
    [
        "axk1",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "deepseek_v4",
        "deepseek_v41",
        "dots3_note",
        "deepseek_mtp",
        "k3_dspark",
        "glm5_next",
        "glm5_next_text",
        "glm_moe_dsa",
        "glm4_moe_lite",
        "glm4_moe_lite_mtp",
        "kimi_k2",
        "kimi_linear",
        "longcat_flash",
        "pangu_ultra_moe",
        "pangu_ultra_moe_mtp",
        "bailing_hybrid",
        "bailing_hybrid_mtp",
        "bailing_hybrid_v3_mtp",
        "hy_v4",
        "hy_v4_mtp",
    ]
)


class MlaCache(enum.Enum):
    """The vLLM attention class the file builds for the cache."""

    LATENT = "MLAAttention"  # the compressed latent and the shared rope key, per token
    PER_HEAD = "Attention"  # k and v per head, v padded to the q/k head size

    @property
    def vllm_class(self) -> str:
        return self.value


def mla_cache(model_type: str | None) -> MlaCache:
    """The cache vLLM 0.32 gives latent attention under ``model_type``."""
    return MlaCache.LATENT if model_type in VLLM_MLA_TYPES else MlaCache.PER_HEAD
