"""Where a GQA expansion of k or v starts: the attention leaf takes k and v before it (kv
head ``h // groups`` serves query head ``h``), proven on the values."""

from __future__ import annotations

import itertools

import torch
from torch.fx import Node

# how many single-input steps back from the attention's k/v an expansion may start
STEPS = 6


def before_expansion(expanded: Node, heads: int) -> Node:
    """The k/v node a GQA expansion (``repeat_interleave``, ``repeat_kv``) made ``expanded``
    from: the nearest earlier value whose kv heads, each repeated for its group, equal
    ``expanded``'s value (checked on the values); ``expanded`` itself when none."""
    node, want = expanded, expanded.meta.get("value")
    for _ in range(4):
        val = node.meta.get("value")
        if torch.is_tensor(val) and val.dim() == 4 and val.shape[1] < heads and heads % val.shape[1] == 0:
            if torch.equal(val.repeat_interleave(heads // val.shape[1], dim=1), want):
                return node
            break
        inputs = [a for a in node.all_input_nodes if torch.is_tensor(a.meta.get("value"))]
        if len(inputs) != 1:
            break
        node = inputs[0]
    return expanded


def permuted_before_expansion(expanded: Node, heads: int) -> tuple[Node, tuple[int, ...]] | None:
    """(node, permutation): the nearest earlier 4-d value that, permuted into
    ``expanded``'s ``[batch, heads, seq, head_dim]`` layout, has fewer heads, each repeated
    for its group equal to ``expanded``'s value (ChatGLM's ``[seq, batch, groups, head_dim]``
    k, unsqueezed, expanded and viewed to all heads, then permuted); else None."""
    node, want = expanded, expanded.meta.get("value")
    if not torch.is_tensor(want) or want.dim() != 4:
        return None
    for _ in range(STEPS):
        inputs = [a for a in node.all_input_nodes if torch.is_tensor(a.meta.get("value"))]
        if len(inputs) != 1:
            return None
        node = inputs[0]
        val = node.meta["value"]
        if val.dim() != 4 or val.numel() >= want.numel():
            continue
        for order in itertools.permutations(range(4)):
            laid = val.permute(order)
            groups = laid.shape[1]
            if (
                laid.shape[0] == want.shape[0]
                and laid.shape[2:] == want.shape[2:]
                and heads % groups == 0
                and torch.equal(laid.repeat_interleave(heads // groups, dim=1), want)
            ):
                return node, order
    return None


def expanded_from(value: torch.Tensor, dim: int, kv_heads: int) -> bool:
    """``value``'s ``dim`` holds ``kv_heads`` groups of equal consecutive heads: a GQA
    expansion (kv head ``h // groups`` for head ``h``) of ``kv_heads`` heads, checked on
    every element (Falcon-40B broadcasts k and v to every query head before its rope)."""
    heads = value.shape[dim]
    if not (0 < kv_heads < heads and heads % kv_heads == 0):
        return False
    firsts = value.index_select(dim, torch.arange(0, heads, heads // kv_heads))
    return torch.equal(firsts.repeat_interleave(heads // kv_heads, dim=dim), value)
