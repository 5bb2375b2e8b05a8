"""Tensors a forward creates from sizes alone (``torch.zeros((n, h))``), recorded as nodes.

fx records only the calls that touch a proxy, so a tensor built from concrete sizes is a
constant. When the forward then updates it in place with traced values
(``out.index_add_(0, rows, y)``, the per-expert loop of older MoE code), whatever reads it
afterwards runs eagerly and is baked into the graph as a constant: the block's output
leaves the graph. While a trace runs, these factories record a node instead, so the tensor,
its in-place updates and its readers all stay in the graph.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch

FACTORIES = ("zeros", "ones", "empty", "full", "arange")  # arange: positions counted from sizes


@contextmanager
def patched_torch(names, wrap) -> Iterator[None]:
    """``torch.<name>`` for each of ``names`` replaced by ``wrap(original)`` inside the block."""
    originals = {name: getattr(torch, name) for name in names}
    for name, original in originals.items():
        setattr(torch, name, functools.wraps(original)(wrap(original)))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)


def recorded_factories(tracer):
    """``torch.<factory>`` record a node on ``tracer`` while tracing, except while the
    tracer evaluates a node's value (``tracer.evaluating``: real modules run then)."""

    def recording(original):
        def call(*args, **kwargs):
            if tracer.evaluating:
                return original(*args, **kwargs)
            return tracer.create_proxy("call_function", original, args, kwargs)

        return call

    return patched_torch(FACTORIES, recording)
