"""Inputs vLLM does not pass are left at their defaults only where the layer, replayed
without them, gives the same hidden states."""

from __future__ import annotations

import torch
from torch import nn

from hfrewrite.analyze.layer_defaults import free_defaults


class Layer(nn.Module):
    def __init__(self, flag_scales: bool):
        super().__init__()
        self.flag_scales = flag_scales

    def forward(self, hidden_states, mask, use_cache=False, layer_past=None, scale=1.0):
        out = hidden_states * 2 * scale
        if use_cache and self.flag_scales:
            out = out * 3  # a flag that changes the hidden states
        present = (hidden_states,) if use_cache else None
        return out, present


def test_flags_that_only_shape_the_output_tuple_are_free():
    x = torch.randn(2, 3)
    layer = Layer(flag_scales=False)
    hidden = layer(x, None, use_cache=True)[0]
    assert free_defaults(layer, (x, None), {"use_cache": True}, hidden) == (
        "layer_past",
        "scale",
        "use_cache",
    )


def test_a_flag_that_changes_the_hidden_states_is_not():
    x = torch.randn(2, 3)
    layer = Layer(flag_scales=True)
    hidden = layer(x, None, use_cache=True)[0]
    assert free_defaults(layer, (x, None), {"use_cache": True}, hidden) == ("layer_past", "scale")
