"""How one checkpoint tensor may hold q, k and v: one row per layout.

Each row is the plan's fact (``AttentionPlan.qkv_layout``), the reference the analysis
replays (``lanes``: the projection's output taken apart into head-shaped lanes, each of
which must be the value the source computes for that role), and what the file does with
it (``load_helper``: the ``load_weights`` helper that turns the checkpoint tensor into what
vLLM's ``QKVParallelLinear`` loads, "" when it loads as it is; ``report``: the fusion row).
A new layout is one row here, its helper's template in ``passes/load_weights.py``, and its
tests.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

MP_BLOCKS = 4  # CodeGen's model-parallel blocks of its fused projection
Lanes = Callable[[torch.Tensor, int, int, int], "tuple[torch.Tensor, ...] | None"]


def _blocks(out: torch.Tensor, hq: int, hk: int, d: int):
    """``[q; k; v]``: what QKVParallelLinear holds."""
    b, s = out.shape[:2]
    q, k, v = out.split([hq * d, hk * d, hk * d], dim=-1)
    return q.reshape(b, s, hq, d), k.reshape(b, s, hk, d), v.reshape(b, s, hk, d)


def _grouped(out: torch.Tensor, hq: int, hk: int, d: int):
    """Per kv head ``[g: its hq/hk query heads, k, v]`` (InternLM2's ``wqkv``; with as many
    kv heads as query heads, GPT-NeoX's and Falcon's per-head ``[h: q k v]``)."""
    b, s = out.shape[:2]
    groups = hq // hk
    grouped = out.reshape(b, s, hk, groups + 2, d)
    return grouped[..., :groups, :].reshape(b, s, hq, d), grouped[..., groups, :], grouped[..., groups + 1, :]


def _per_head(out: torch.Tensor, hq: int, hk: int, d: int):
    return _grouped(out, hq, hk, d) if hq == hk else None


def _mp_blocks_qvk(out: torch.Tensor, hq: int, hk: int, d: int):
    """Four blocks, each ``[q; v; k]`` of a quarter of the heads (CodeGen's ``qkv_proj``, kept
    for its ``mp_num = 4`` TPU partitions). With four heads it reads as per head ``[q v k]``:
    the analysis proves it again at eight heads (analyze/qkv_width.py)."""
    if hq != hk or hq % MP_BLOCKS:
        return None
    b, s = out.shape[:2]
    q, v, k = out.reshape(b, s, MP_BLOCKS, 3, hq // MP_BLOCKS, d).unbind(3)
    return q.reshape(b, s, hq, d), k.reshape(b, s, hq, d), v.reshape(b, s, hq, d)


def _kv_blocks(out: torch.Tensor, hq: int, hk: int, d: int):
    """k and v beside q's own projection, as ``[k; v]``."""
    b, s = out.shape[:2]
    return tuple(x.reshape(b, s, hk, d) for x in out.split(hk * d, dim=-1))


def _kv_per_head(out: torch.Tensor, hq: int, hk: int, d: int):
    """k and v beside q's own projection, per kv head ``[h: k v]`` (TeleChat's ``key_value``)."""
    b, s = out.shape[:2]
    return out.reshape(b, s, hk, 2, d).unbind(-2)


_INTERLEAVED = "The checkpoint interleaves q, k and v per head; load_weights reorders them."


class QkvLayout(enum.Enum):
    """(roles the one tensor holds, reference lanes, load_weights helper, report text,
    the file's comment on the fused layer)."""

    BLOCKS = (
        "qkv",
        _blocks,
        "",
        "[q; k; v] in the checkpoint",
        "The checkpoint holds q, k and v in one tensor, which this layer loads as it is.",
    )
    PER_HEAD = (
        "qkv",
        _per_head,
        "_qkv_per_head_to_blocks",
        "q/k/v interleaved per head in the checkpoint, reordered at load",
        _INTERLEAVED,
    )
    GROUPED = (
        "qkv",
        _grouped,
        "_qkv_per_head_to_blocks",
        "q/k/v grouped per kv head in the checkpoint, reordered at load",
        _INTERLEAVED,
    )
    MP_BLOCKS_QVK = (
        "qkv",
        _mp_blocks_qvk,
        "_qkv_mp_blocks_to_blocks",
        f"{MP_BLOCKS} blocks of [q; v; k] in the checkpoint, reordered at load",
        f"The checkpoint holds {MP_BLOCKS} blocks of [q; v; k]; load_weights reorders them.",
    )
    KV_BLOCKS = ("kv", _kv_blocks, "_kv_split", "[k; v]", "")
    KV_PER_HEAD = ("kv", _kv_per_head, "_kv_split", "k and v per kv head", "")

    def __init__(self, roles: str, lanes: Lanes, load_helper: str, report: str, comment: str) -> None:
        self.comment = comment  # above the fused QKVParallelLinear in the file
        self.roles = roles
        self.lanes = lanes
        self.load_helper = load_helper
        self.report = report

    @property
    def holds_q(self) -> bool:
        """q, k and v in one Linear (else q has its own, beside one holding k and v)."""
        return self.roles == "qkv"


# The order the analysis tries them in: the first whose lanes the values match is the fact.
QKV_ORDER = (QkvLayout.BLOCKS, QkvLayout.PER_HEAD, QkvLayout.GROUPED, QkvLayout.MP_BLOCKS_QVK)
KV_ORDER = (QkvLayout.KV_BLOCKS, QkvLayout.KV_PER_HEAD)
