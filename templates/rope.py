"""vLLM-side rotary embeddings the analysis may need beyond ``get_rope``.

Parsed with libcst by ``passes/vllm_attention.py``, never imported at run time.
"""

import torch
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding


class ReversedRotaryEmbedding(RotaryEmbedding):
    """vLLM's rotary embedding turning by -theta, as the source's rope does (proven by
    replay): the same kernels, with the sin half of the cos/sin table negated."""

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        cos, sin = super()._compute_cos_sin_cache().chunk(2, dim=-1)
        return torch.cat((cos, -sin), dim=-1)
