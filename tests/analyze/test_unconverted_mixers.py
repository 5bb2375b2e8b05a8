"""analyze/unconverted_mixers.py: a kind is named by its parts' names and their shapes both;
a kind hfrewrite proves (Mamba-1's selective scan, analyze/mamba1.py) is not named at all."""

import torch
from torch import nn

from hfrewrite.analyze.unconverted_mixers import KINDS, unconverted_mixer


def _mamba1() -> nn.Module:
    block = nn.Module()
    inner, state, rank = 8, 4, 2
    block.in_proj, block.out_proj = nn.Linear(4, 2 * inner), nn.Linear(inner, 4)
    block.conv1d = nn.Conv1d(inner, inner, 3, groups=inner)
    block.x_proj, block.dt_proj = nn.Linear(inner, rank + 2 * state), nn.Linear(rank, inner)
    block.A_log = nn.Parameter(torch.zeros(inner, state))
    block.D = nn.Parameter(torch.zeros(inner))
    return block


def _kimi(convolved: bool) -> nn.Module:
    block = nn.Module()
    for name in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"):
        setattr(block, name, nn.Linear(8, 8))
    block.forget_gate = nn.Module()
    block.forget_gate.A_log = nn.Parameter(torch.zeros(2))
    block.forget_gate.dt_bias = nn.Parameter(torch.zeros(8))
    block.forget_gate.proj = nn.Linear(8, 8)
    block.q_conv = nn.Conv1d(8, 8, 3, groups=8 if convolved else 1)
    return block


def test_a_selective_scan_is_no_unconverted_kind():
    assert unconverted_mixer(_mamba1()) is None


def test_a_kind_is_named_by_its_shapes_too():
    kimi = next(kind for kind in KINDS if "Kimi" in kind.reason)
    assert unconverted_mixer(_kimi(True)) == kimi.reason
    # the same names without a depthwise convolution: not called a Kimi block
    assert unconverted_mixer(_kimi(False)) is None
