"""What an attention or MLP block hands back to its layer: the outputs the layer's hidden
states read, and whether the block ends by adding a tensor it was given (BLOOM's and
TeleChat's ``dropout_add(out, residual)``: the layer's residual add done inside the block)."""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from hfrewrite.analyze.dataflow import ancestors
from hfrewrite.analyze.trace import Traced, past_identity_dropouts, value


def _layer_result(traced: Traced):
    """What the traced layer returns: a node, or a tuple of them."""
    return next(n for n in traced.graph.nodes if n.op == "output").args[0]


def returns_tuple(traced: Traced) -> bool:
    """The layer's forward returned a tuple (transformers 4.x: hidden states first), as a
    tuple of nodes or as one node computing it (``(x,) + rest``)."""
    result = _layer_result(traced)
    return isinstance(result, tuple | list) or isinstance(result.meta.get("value"), tuple | list)


def hidden_output(traced: Traced) -> Node | None:
    """The node of the layer's hidden states: its output, or the first element of the tuple
    it returns (weights and caches beside it are not read by the next layer)."""
    result = _layer_result(traced)
    hidden = result[0] if isinstance(result, tuple | list) and result else result
    return hidden if isinstance(hidden, Node) else None


def read_outputs(traced: Traced, path: str) -> list[Node]:
    """``traced.outputs_of(path)`` that the layer's hidden states (its output, or the first
    element of the tuple it returns) are computed from: attention weights returned beside
    them do not count."""
    hidden = hidden_output(traced)
    live = {hidden, *ancestors(hidden, None)} if hidden is not None else set()
    inside = set(traced.nodes_in(path))
    return [
        n
        for n in traced.outputs_of(path)
        if n is hidden or any(u not in inside and u in live for u in n.users)
    ]


def adds_given_tensor(output: Node, end: Node, traced: Traced, path: str) -> bool:
    """``output`` is ``end + r`` (either order, past identity dropouts), ``r`` a tensor of
    the same shape computed outside the block (an argument the layer passed it)."""
    inside = set(traced.nodes_in(path))
    if not (
        output.op == "call_function"
        and output.target in (operator.add, torch.add)
        and len(output.args) == 2
        and not output.kwargs
        and end in output.args
        and all(isinstance(a, Node) for a in output.args)
    ):
        return False
    other = output.args[1] if output.args[0] is end else output.args[0]
    return (
        other not in inside
        and torch.is_tensor(value(other))
        and value(other).shape == value(end).shape
        and past_identity_dropouts(output, traced, path) is output
    )
