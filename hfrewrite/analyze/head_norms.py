"""Whether per-head q/k norms may run on one tensor-parallel rank's heads.

Each rank of vLLM's ``QKVParallelLinear`` holds a slice of the heads. A norm that treats every
head alike (qwen3's ``RMSNorm(head_dim)``) runs on that slice as it is. A norm with weights
of its own per head (StableLM-2's ``norms[h]``, Command R+'s ``[heads, head_dim]`` weight) is
built for all heads, as the checkpoint holds it: the file runs it on all heads' places, the
rank's heads among zeros, and takes the rank's heads back (``templates/head_norm.py``). Both
need each head normalised apart from the others, which is proven here on random inputs, with
the norm's own parameters and with random ones.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from hfrewrite.analyze.plan import refuse

_ATOL = 1e-6


def own_weights_per_head(norms: dict[str, nn.Module], heads: dict[str, tuple[int, int]]) -> bool:
    """True where a q or k norm holds weights of its own per head, False where both treat
    every head alike; refuses a norm whose heads are not normalised apart. ``heads``: the
    role's head count and head_dim; the norms run as the file runs them, on
    ``[tokens, heads, head_dim]``."""
    own = False
    generator = torch.Generator().manual_seed(0)
    for role, module in norms.items():
        count, head_dim = heads[role]
        dtype = next((p.dtype for p in module.parameters()), torch.float32)
        x = 2 * torch.randn(5, count, head_dim, generator=generator).to(dtype) + 0.5
        randomised = _with_random_parameters(module)  # a checkpoint's weights differ per head
        for m in (module, randomised):
            if not _heads_apart(m, x):
                refuse(
                    "vllm_attention",
                    f"the {role} norm does not normalise each head apart (checked on random "
                    "heads): a rank holding some of the heads could not compute it",
                )
        own = own or not _alike_per_head(randomised, x)
    return own


def _heads_apart(module: nn.Module, x: torch.Tensor) -> bool:
    """Head ``h`` of the output is the same with every other head of the input zero: what the
    file relies on when it places a rank's heads among zeros."""
    with torch.no_grad():
        full = module(x)
        for h in range(x.shape[1]):
            alone = torch.zeros_like(x)
            alone[:, h] = x[:, h]
            if not torch.allclose(module(alone)[:, h], full[:, h], atol=_ATOL, rtol=1e-5):
                return False
    return True


def _alike_per_head(module: nn.Module, x: torch.Tensor) -> bool:
    """The norm commutes with moving the heads round by one: every head normalised alike."""
    with torch.no_grad():
        moved = module(x.roll(1, dims=1))
        return torch.allclose(moved, module(x).roll(1, dims=1), atol=_ATOL, rtol=1e-5)


def _with_random_parameters(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters are random: a fresh model's norm weights are all
    ones, equal across heads, where a trained checkpoint's are not."""
    randomised = copy.deepcopy(module)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in randomised.parameters():
            p.copy_(1 + 0.5 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return randomised
