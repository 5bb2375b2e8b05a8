"""vLLM-side code for q/k norms with weights of their own per head.

Parsed with libcst by ``passes/vllm_attention.py``, never imported at run time.
"""

import torch
from torch import nn


def norm_rank_heads(
    norm: nn.Module, x: torch.Tensor, total_heads: int, first_head: int
) -> torch.Tensor:
    """``norm``, built for all ``total_heads`` heads as the checkpoint holds
    it, applied to this rank's heads ``x`` ([tokens, heads, head_dim]), which
    start at ``first_head``. Each head is normalised apart (proven), so the
    other heads' places may hold zeros."""
    heads = x.shape[-2]
    if heads == total_heads:
        return norm(x)
    every_head = x.new_zeros(*x.shape[:-2], total_heads, x.shape[-1])
    every_head[..., first_head : first_head + heads, :] = x
    return norm(every_head)[..., first_head : first_head + heads, :]
