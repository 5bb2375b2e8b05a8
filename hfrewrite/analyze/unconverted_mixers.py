"""Mixers vLLM has a layer for that no file could run here: recognised by their parts, and
refused with what they are and why, rather than with the general "no softmax attention".
Each claim is about vLLM 0.32's CPU build, checked when the row was written. A kind that
comes to run here is a row moved to analyze/mixers.py, with its proof."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class _Kind:
    children: frozenset[str]  # the parameter-holding children the block has (at least these)
    params: frozenset[str]  # its own parameters (at least these)
    reason: str
    # what the parts' shapes show of the kind, beyond their names
    shapes: Callable[[nn.Module], bool] = lambda block: True


def _forget_gate(block: nn.Module) -> bool:
    """Kimi's shapes: a forget gate with a decay and a time-step bias of its own, a depthwise
    convolution over the projected q, k and v."""
    gate = {n for n, _ in block.forget_gate.named_parameters(recurse=False)}
    convs = [m for m in block.modules() if isinstance(m, nn.Conv1d) and m.groups == m.in_channels]
    return {"A_log", "dt_bias"} <= gate and bool(convs)


KINDS = (
    _Kind(
        frozenset({"q_proj", "k_proj", "v_proj", "forget_gate", "b_proj", "g_a_proj", "g_b_proj", "o_proj"}),
        frozenset(),
        "a Kimi delta attention block (a forget gate per channel, a convolution on q, k and v): "
        "vLLM runs such blocks as its KimiDeltaAttention, on triton kernels only, none on CPU, and "
        "hfrewrite has no CPU path of its own for it (as it has for Mamba-1 blocks and OLMo-hybrid's "
        "gated delta nets), so no file holding one could run or be validated here",
        _forget_gate,
    ),
)


def unconverted_mixer(module: nn.Module) -> str | None:
    """The reason of the first kind a submodule of ``module`` has the parts of, else None."""
    for block in module.modules():
        children = {n for n, c in block.named_children() if any(True for _ in c.parameters())}
        params = {n for n, _ in block.named_parameters(recurse=False)}
        for kind in KINDS:
            if kind.children <= children and kind.params <= params and kind.shapes(block):
                return kind.reason
    return None
