"""Projections that keep their weight as ``[in, out]`` and multiply by it untransposed
(GPT-2's ``Conv1D``: ``x @ weight + bias``), proven on values and swapped for ``nn.Linear``.

A candidate is a module of a class that is not ``nn.Linear``, has no children, and holds a
2-D ``weight`` and an optional 1-D ``bias`` of its output width. Two replays prove it:

- its forward equals ``x @ weight + bias`` on a random input;
- its class built as ``Cls(a, b)`` holds a ``[b, a]`` weight (and an ``[a]`` bias) and
  still computes that: the source's ``Cls(a, b)`` is ``nn.Linear(b, a)`` with the weight
  transposed.

Every proven instance in the traced model is then replaced by an ``nn.Linear`` holding the
transposed weight, so the rest of the analysis sees plain projections; the file builds
``nn.Linear(b, a)`` where the source builds ``Cls(a, b)``, and load_weights transposes the
checkpoint tensors of those modules (``ModelPlan.transposed_linears``)."""

from __future__ import annotations

import inspect
import re

import torch
from torch import nn


def swap_transposed_linears(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Replace each proven module of ``model``'s layers by an equal ``nn.Linear``; (the proven
    class names, the module paths below the layer index: ``attn.c_attn``)."""
    proven: dict[type, bool] = {}
    swapped: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not (_candidate(module) and re.search(r"\.\d+\.", name)):
            continue  # (inside the decoder stack only: load_weights finds them by suffix)
        cls = type(module)
        if cls not in proven:
            proven[cls] = _constructor_transposes(cls)
        if proven[cls] and _computes(module):
            swapped.append((name, module))
    for name, module in swapped:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, _as_linear(module))
    classes = tuple(sorted({type(m).__name__ for _, m in swapped}))
    paths = tuple(sorted({re.split(r"\.\d+\.", name, maxsplit=1)[1] for name, _ in swapped}))
    return classes, paths


def _candidate(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear | nn.Embedding) or next(module.children(), None) is not None:
        return False
    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.get("weight"), params.get("bias")
    return (
        set(params) <= {"weight", "bias"}
        and weight is not None
        and weight.dim() == 2
        and (bias is None or (bias.dim() == 1 and bias.shape[0] == weight.shape[1]))
    )


def _computes(module: nn.Module) -> bool:
    """``module(x) == x @ weight + bias`` on a random ``x``."""
    weight, bias = module.weight, getattr(module, "bias", None)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, weight.shape[0], generator=generator, dtype=weight.dtype)
    try:
        with torch.no_grad():
            out = module(x)
            want = x @ weight + (bias if bias is not None else 0)
    except Exception:  # noqa: BLE001 - its own forward failed on a plain input: not proven
        return False
    return (
        torch.is_tensor(out) and out.shape == want.shape and torch.allclose(out, want, rtol=1e-5, atol=1e-6)
    )


def _constructor_transposes(cls: type) -> bool:
    """``cls(a, b)`` builds a ``[b, a]`` weight (and an ``[a]`` bias) computing the same."""
    try:
        if len([p for p in inspect.signature(cls).parameters.values() if p.default is p.empty]) != 2:
            return False
        with torch.no_grad():
            built = cls(5, 3)
            for param in built.parameters():
                param.normal_()
    except Exception:  # noqa: BLE001 - it cannot be built from two sizes
        return False
    bias = getattr(built, "bias", None)
    return (
        tuple(built.weight.shape) == (3, 5)
        and (bias is None or tuple(bias.shape) == (5,))
        and _candidate(built)
        and _computes(built)
    )


def _as_linear(module: nn.Module) -> nn.Linear:
    weight, bias = module.weight, getattr(module, "bias", None)
    linear = nn.Linear(weight.shape[0], weight.shape[1], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight.t())
        if bias is not None:
            linear.bias.copy_(bias)
    return linear
