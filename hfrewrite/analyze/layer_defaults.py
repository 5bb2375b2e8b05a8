"""Inputs of a decoder layer that vLLM does not pass, proven to be free to take their defaults.

vLLM calls a carried layer as ``layer(positions, hidden_states)``: every other parameter
takes its default. Where the model passed a parameter with a literal default (``use_cache``,
``output_attentions``, ``layer_past=None``) another value, the layer is run again on the same
inputs with those parameters left out; they are proven free when its hidden states (its
output, or the first element of the tuple it returns) are unchanged, value for value.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

_LITERALS = (bool, int, float, str, type(None))


def free_defaults(layer: nn.Module, args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[str, ...]:
    """Parameters of ``layer.forward`` with a literal default that may take it: those the
    model did not pass, and those whose default reproduces ``hidden`` (the traced output)."""
    try:
        signature = inspect.signature(type(layer).forward)
        bound = signature.bind(layer, *args, **kwargs).arguments
    except (TypeError, ValueError):
        return ()
    literal = {
        name: p.default
        for name, p in signature.parameters.items()
        if p.default is not inspect.Parameter.empty and isinstance(p.default, _LITERALS)
    }
    passed = {name for name in literal if name in bound and bound[name] is not literal[name]}
    if passed and not _same_hidden(layer, {k: v for k, v in bound.items() if k not in passed}, hidden):
        return tuple(sorted(set(literal) - passed))
    return tuple(sorted(literal))


def _same_hidden(layer: nn.Module, arguments: dict, hidden: torch.Tensor) -> bool:
    arguments = dict(arguments)
    arguments.pop("self", None)
    extra = arguments.pop("kwargs", {}) if isinstance(arguments.get("kwargs"), dict) else {}
    try:
        with torch.no_grad():
            out = layer(**arguments, **extra)
    except Exception:  # noqa: BLE001 - the layer needs what was left out
        return False
    out = out[0] if isinstance(out, tuple | list) else out
    return (
        torch.is_tensor(out)
        and torch.is_tensor(hidden)
        and out.shape == hidden.shape
        and torch.equal(out, hidden)
    )
