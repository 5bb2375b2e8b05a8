"""Norm facts: an RMSNorm's eps and kind (analyze/norm_kinds.py).

Pattern: ``x * rsqrt(mean(x**2) + eps) * (offset + weight)``, with offset 0 (llama's
``weight * x``) or 1 (gemma's ``(1 + weight) * x``), which vLLM's ``RMSNorm`` (offset 0)
and ``GemmaRMSNorm`` (offset 1) compute.

How: trace the norm module on a small tensor and read eps as the float added to a
``mean``; then run it with zero and with random weights to measure the offset and check
that the whole formula holds (fail closed: LayerNorm, biases, other formulas do not).
"""

from __future__ import annotations

import inspect
import operator

import torch
from torch import nn

from hfrewrite.analyze.norm_kinds import KNOWN_FORMS, kind_of_offset
from hfrewrite.analyze.plan import NoMatch, NormPlan
from hfrewrite.analyze.trace import trace

_ADD = (operator.add, torch.add, "add")
_MEAN = (torch.mean, "mean")


def analyze_norm(module: nn.Module) -> NormPlan | NoMatch:
    """Facts of one RMSNorm module instance."""
    cls = type(module).__name__
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return NoMatch("rms_norm", cls, "no 1-D weight parameter")
    if sorted(n for n, _ in module.named_parameters()) != ["weight"]:
        return NoMatch("rms_norm", cls, "parameters other than weight")
    x = torch.randn(2, 3, weight.shape[0], generator=torch.Generator().manual_seed(0))
    graph = trace(module, (x,)).graph
    eps = [
        a
        for n in graph.nodes
        if n.op in ("call_function", "call_method") and n.target in _ADD
        for a in n.args
        if isinstance(a, float) and any(_is_mean(b) for b in n.args)
    ]
    if len(eps) != 1:
        return NoMatch(
            "rms_norm",
            cls,
            f"found {len(eps)} `mean(x**2) + eps` in forward, expected one",
        )
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps[0])
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.zero_()
            kind = kind_of_offset(round(float((module(x) / rms).mean()), 4))
            weight.copy_(torch.rand_like(weight))
            holds = kind is not None and torch.allclose(
                module(x), kind.reference(x, eps[0], weight), atol=1e-5
            )
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    if not holds:
        return NoMatch("rms_norm", cls, f"output is not {KNOWN_FORMS}")
    return NormPlan(cls, kind, eps[0])


def config_fields(module: nn.Module, eps: float, config) -> tuple[str, str] | None | str:
    """For a norm class whose ``__init__`` takes one argument (the config), the config fields
    equal to its size and to its eps (each the only one); a reason when they are not unique;
    None for classes taking their sizes."""
    try:
        params = list(inspect.signature(type(module).__init__).parameters)[1:]
    except (TypeError, ValueError):
        return None
    if len(params) != 1:
        return None
    try:  # the one argument is the config: the class builds from it, to this size
        built = type(module)(config)
    except Exception:  # noqa: BLE001 - it is not: another one-argument norm
        return None
    if getattr(built, "weight", None) is None or built.weight.shape != module.weight.shape:
        return None
    values = {k: v for k, v in vars(config).items() if not k.startswith("_")}
    size = [k for k, v in values.items() if type(v) is int and v == module.weight.shape[0]]
    eps_fields = [k for k, v in values.items() if type(v) is float and v == eps]
    if len(size) != 1 or len(eps_fields) != 1:
        return (
            f"{type(module).__name__} is built from the config alone, and no one config field "
            f"holds its size ({size}) and its eps ({eps_fields})"
        )
    return size[0], eps_fields[0]


def _is_mean(node: object) -> bool:
    return getattr(node, "op", None) in ("call_function", "call_method") and node.target in _MEAN
