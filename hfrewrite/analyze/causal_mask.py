"""A mask handed to a direct SDPA call, proven the causal mask by its values (and by what it
is computed from: never the hidden states' values)."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from hfrewrite.analyze.dataflow import ancestors

_SHAPE_ONLY = {("call_method", "size"), ("call_method", "dim")}


def _reads_layer_inputs(node: Node, but_masks: bool = False) -> bool:
    """Whether ``node``'s value depends on a layer input's values; sizes read off an input
    (``key.size(1)``; ``.shape`` is concrete, not traced) carry no values and are not followed.
    ``but_masks``: inputs other than the first (the hidden states) do not count."""
    first = next((n for n in node.graph.nodes if n.op == "placeholder"), None)
    for n in ancestors(node, None):
        if n.op == "placeholder" and n is not node and (n is first or not but_masks):
            users = [u for u in n.users if (u.op, u.target) not in _SHAPE_ONLY]
            if _feeds(users, node):
                return True
    return False


def _feeds(starts: list[Node], target: Node) -> bool:
    """Whether ``target`` is reached from ``starts`` along uses, not through shape reads."""
    seen, todo = set(starts), list(starts)
    while todo:
        cur = todo.pop()
        if cur is target:
            return True
        for user in cur.users:
            if user not in seen and (user.op, user.target) not in _SHAPE_ONLY:
                seen.add(user)
                todo.append(user)
    return False


def causal_mask(mask: Any, length: int, layer_masks: bool = False) -> bool:
    """``mask`` is the causal mask of ``length`` queries over as many keys: boolean
    ``tril`` or additive 0 / very negative, the same for every leading index. Built from
    constants alone (no layer input: not a padding mask), unless ``layer_masks``: a mask
    input the base model built from the (unpadded) example, for a config with no window, is
    the causal mask vLLM's calling convention gives each sequence (never one that reads the
    hidden states' values)."""
    if isinstance(getattr(mask, "node", None), Node):  # a traced value
        if _reads_layer_inputs(mask.node, but_masks=layer_masks):
            return False
        mask = mask.node.meta["value"]
    if not torch.is_tensor(mask) or mask.shape[-2:] != (length, length):
        return False
    return allows_exactly(mask, torch.ones(length, length, dtype=torch.bool).tril())


def allows_exactly(mask: torch.Tensor, allowed: torch.Tensor) -> bool:
    """``mask`` (boolean, or additive 0 / very negative) lets each query see exactly the keys
    ``allowed`` [queries, keys] marks, the same for every leading index."""
    if mask.dim() < 2 or mask.shape[-2:] != allowed.shape:
        return False
    allowed = allowed.expand(*mask.shape[:-2], *allowed.shape)
    if mask.dtype == torch.bool:
        return torch.equal(mask, allowed)
    if not mask.is_floating_point():
        return False
    very_negative = mask <= torch.finfo(mask.dtype).min / 2
    return bool((mask[allowed] == 0).all() and very_negative[~allowed].all())


def windowed(config) -> bool:
    """Whether the config sets any attention window (a mask over a short example run would
    look causal without it)."""
    return any("window" in key and value not in (None, False, 0) for key, value in config.to_dict().items())
