"""analyze/unconverted_mixers.py: a kind is named by its parts' names and their shapes both."""

import torch
from torch import nn

from hfrewrite.analyze.unconverted_mixers import KINDS, unconverted_mixer


def _mamba1(state_per_channel: bool) -> nn.Module:
    block = nn.Module()
    inner, state, rank = 8, 4, 2
    block.in_proj, block.out_proj = nn.Linear(4, 2 * inner), nn.Linear(inner, 4)
    block.conv1d = nn.Conv1d(inner, inner, 3, groups=inner)
    block.x_proj, block.dt_proj = nn.Linear(inner, rank + 2 * state), nn.Linear(rank, inner)
    block.A_log = nn.Parameter(torch.zeros(inner, state) if state_per_channel else torch.zeros(inner))
    block.D = nn.Parameter(torch.zeros(inner))
    return block


def test_a_selective_scan_is_named_by_its_shapes_too():
    assert unconverted_mixer(_mamba1(True)) == KINDS[0].reason
    # the same names, a decay per head (Mamba-2's): not called a Mamba-1 block
    assert unconverted_mixer(_mamba1(False)) is None
