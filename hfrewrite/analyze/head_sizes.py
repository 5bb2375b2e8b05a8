"""The attention's head counts and head sizes, read off the values its call was traced with,
checked against its projections' widths: q's heads, k's and v's (fewer where grouped), one head
size for q and k, and v's own where narrower (MiMo-V2-Flash's, padded by the file)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from hfrewrite.analyze.gqa_expansion import expanded_from
from hfrewrite.analyze.plan import refuse
from hfrewrite.analyze.trace import value


class Heads(NamedTuple):
    """The attention's head counts and head size, read off the traced q/k/v values."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    packed: bool = False  # q's projection holds [heads, 2 * head_dim], q the first half of each
    v_head_dim: int = 0  # v's head size: head_dim, or narrower (MiMo-V2-Flash)


def heads_of(args: dict, proj) -> Heads:
    """(heads, kv heads, head_dim, ...) from the [batch, heads, seq, head_dim] values of the
    attention's inputs ``args``; ``proj``: its projections (attention.py's ``_Projections``)."""
    q, k = proj.q, proj.k
    qv, kv, vv = (value(args[role]) for role in "qkv")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (qv, kv, vv)):
        refuse("vllm_attention", "q, k and v are not [batch, heads, seq, head_dim]")
    heads, kv_heads, head_dim, v_head_dim = qv.shape[1], kv.shape[1], qv.shape[3], vv.shape[3]
    if kv.shape[3] != head_dim or vv.shape[1] != kv_heads:
        refuse(
            "vllm_attention",
            f"q, k and v shapes differ: {tuple(qv.shape)}, {tuple(kv.shape)}, {tuple(vv.shape)}",
        )
    if v_head_dim > head_dim or (v_head_dim != head_dim and proj.fused is not None):
        refuse(
            "vllm_attention",
            f"v heads of {v_head_dim} beside q and k heads of {head_dim}: vLLM's CPU attention has one "
            "head size, and the file pads only narrower v heads of separate projections",
        )
    if v_head_dim != head_dim and proj.v.out_features != kv_heads * v_head_dim:
        refuse("fuse_qkv", f"{proj.v.attr}'s out_features are not kv heads * v head size ({v_head_dim})")
    if k.out_features != kv_heads * head_dim and all(
        expanded_from(t, 1, k.out_features // head_dim) for t in (kv, vv)
    ):  # k and v given expanded to every query head (Falcon-40B's broadcast_to): proven
        kv_heads = k.out_features // head_dim
    # q's projection twice the heads: q and another tensor per head (Qwen3-Next's output
    # gate), proven by the head layout and the output gate's replay
    packed = q.out_features == 2 * heads * head_dim and k.out_features == kv_heads * head_dim
    if packed and proj.fused is not None:
        refuse("fuse_qkv", f"{q.attr} holds q, k and v with q twice the heads: no layout of q/k/v")
    if not packed and (q.out_features != heads * head_dim or k.out_features != kv_heads * head_dim):
        refuse("fuse_qkv", f"out_features are not heads * head_dim ({head_dim})")
    if heads % kv_heads:
        refuse("vllm_attention", f"{heads} heads not divisible by {kv_heads} kv heads")
    return Heads(heads, kv_heads, head_dim, packed, v_head_dim)
