"""GPT-2's Conv1D kind of projection (``x @ weight + bias``, built ``Cls(out, in)``) is
proven on values and swapped for an equal nn.Linear; look-alikes are left alone."""

from __future__ import annotations

import torch
from torch import nn

from hfrewrite.analyze.transposed_linears import swap_transposed_linears


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], -1)


class LooksTransposed(Conv1D):
    """The same parameters and shapes, another function (the bias added twice)."""

    def forward(self, x):
        return x @ self.weight + 2 * self.bias


class Model(nn.Module):
    def __init__(self, projection):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"c_attn": projection(12, 4)}) for _ in range(2))
        self.head = projection(4, 4)  # outside the layer stack: not swapped


def test_conv1d_is_swapped_for_an_equal_linear_inside_the_layers():
    torch.manual_seed(0)
    model = Model(Conv1D)
    before = model.layers[1]["c_attn"]
    x = torch.randn(2, 3, 4)
    want = before(x)
    classes, paths = swap_transposed_linears(model)
    assert (classes, paths) == (("Conv1D",), ("c_attn",))
    after = model.layers[1]["c_attn"]
    assert type(after) is nn.Linear and (after.in_features, after.out_features) == (4, 12)
    assert torch.allclose(after(x), want, atol=1e-6)
    assert type(model.head) is Conv1D


def test_a_class_computing_something_else_is_left_as_it_is():
    torch.manual_seed(0)
    model = Model(LooksTransposed)
    assert swap_transposed_linears(model) == ((), ())
    assert type(model.layers[0]["c_attn"]) is LooksTransposed
