"""nn.Linear subclasses are linears only when their forward is proven on values, and plain
functions held as attributes are dropped only when they return their arguments unchanged."""

from __future__ import annotations

import libcst as cst
from torch import nn

from hfrewrite.analyze.identity_attributes import identity_attributes
from hfrewrite.analyze.linear_classes import is_linear, prove_linear_classes
from hfrewrite.emit.torch_names import torch_nn_as_nn


class MatmulLinear(nn.Linear):
    """Falcon-RW's Linear: nn.Linear's function spelled by hand."""

    def forward(self, x):
        out = x @ self.weight.T
        return out if self.bias is None else out + self.bias


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class SizedLinear(nn.Linear):
    def __init__(self, n):
        super().__init__(n, n)

    def forward(self, x):
        return x @ self.weight.T + self.bias


def test_only_proven_subclasses_are_linears():
    model = nn.ModuleList(
        [MatmulLinear(4, 3), MatmulLinear(4, 3, bias=False), ScaledLinear(4, 3), SizedLinear(4)]
    )
    assert prove_linear_classes(model) == ("MatmulLinear",)  # SizedLinear: its own constructor
    assert [is_linear(m) for m in model] == [True, True, False, True]
    assert is_linear(nn.Linear(2, 2)) and not is_linear(nn.Embedding(2, 2))


def test_proven_classes_are_built_as_nn_linear():
    src = "class MatmulLinear(nn.Linear):\n    pass\n\n\nx = MatmulLinear(4, 3, bias=False)\ny = Other(4)\n"
    out = torch_nn_as_nn(cst.parse_module(src), ("MatmulLinear", "Other")).code  # Other: not defined here
    assert "x = nn.Linear(4, 3, bias=False)\ny = Other(4)\n" in out
    assert out.startswith("from torch import nn\n")


class WithFunctions(nn.Module):
    def __init__(self):
        super().__init__()
        self.maybe_rotary = lambda q, k: (q, k)  # identity: rope off
        self.swapped = lambda q, k: (k, q)
        self.scaled = lambda q: q * 2
        self.passthrough = lambda q: q
        self.proj = nn.Linear(2, 2)


def test_identity_functions_are_found_by_replay():
    assert identity_attributes(WithFunctions()) == ["maybe_rotary", "passthrough"]
