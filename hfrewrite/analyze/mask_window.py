"""A hand-written attention's mask held in a boolean buffer of its module (GPT-Neo's
``self.bias``: ``tril``, and for local layers the band of the last ``window_size`` keys).

The fold (analyze/manual_attention.py) proves the window on the example run's values: causal
SDPA with that band reproduces the traced output. The example is a few tokens long, so a
window is only seen where the shrunk config's window is shorter than it; the full window of
a real config lives in the buffer the source's ``__init__`` builds from it. This module
finds that buffer (the mask the scores are selected by, taken from it by slicing alone) and
proves that all of it, not just the slice the example read, is the causal band of the proven
window: the file then reads each layer's window off the buffer its own ``__init__`` built
(``causal_window``, emit/position_code.py), and a buffer of another shape fails at load.
"""

from __future__ import annotations

import operator

import torch
from torch import nn
from torch.fx import Node

from hfrewrite.analyze.trace import value

_WHERE = (torch.where, "where")
# what may stand between the buffer and the mask the scores read: slices and views of it
_TAKES = (operator.getitem, "view", "reshape", "to", "bool", "contiguous", "expand")


def band(length: int, window: int | None) -> torch.Tensor:
    """Which keys each query sees: causal, within the last ``window`` positions when given."""
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    return allowed if window is None else allowed & ~allowed.tril(-window)


def windowed_sdpa(query, key, value_, scaling, window: int) -> torch.Tensor:
    """torch's SDPA over ``[b, heads, s, d]`` with the causal band of ``window`` keys."""
    mask = band(query.shape[-2], window).to(query.device)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value_, attn_mask=mask, scale=scaling)


def mask_buffer(steps: list[Node], module: nn.Module) -> str | None:
    """The name in ``module`` of the boolean buffer the scores are selected by, True keeping
    a score (``torch.where(mask, scores, min)``), in the one step that does so, else None."""
    found = []
    for node in steps:
        if _is(node, _WHERE) and len(node.args) == 3:
            scores_at = [i for i in (1, 2) if _is_scores(node, i)]
            if scores_at == [1]:  # True in the mask keeps the score
                found.append(node.args[0])
    if len(found) != 1:
        return None
    return _buffer_of(found[0], module)


def proven_band(buffer, window: int | None) -> bool:
    """The whole buffer is the causal band of ``window`` (``tril`` for None), in its last two
    dims, the leading ones of size 1."""
    if not torch.is_tensor(buffer) or buffer.dtype != torch.bool or buffer.dim() < 2:
        return False
    if any(size != 1 for size in buffer.shape[:-2]) or buffer.shape[-1] != buffer.shape[-2]:
        return False
    allowed = buffer.reshape(buffer.shape[-2:])
    return torch.equal(allowed, band(allowed.shape[-1], window))


def _is_scores(node: Node, at: int) -> bool:
    arg = node.args[at]
    return isinstance(arg, Node) and torch.is_tensor(value(arg)) and value(arg).shape == value(node).shape


def _buffer_of(mask: object, module: nn.Module) -> str | None:
    """The name of ``module``'s buffer the mask is sliced or viewed from, else None. A slice
    the tracer took eagerly (its bounds are sizes, known while tracing) is a constant of the
    graph: it is the buffer's when it shares the buffer's memory."""
    node = mask
    for _ in range(6):
        if not isinstance(node, Node):
            return None
        if node.op == "get_attr":
            taken = getattr(node.graph.owning_module, node.target, None)
            return next(
                (
                    name
                    for name, buffer in module.named_buffers()
                    if torch.is_tensor(taken) and _same_memory(taken, buffer)
                ),
                None,
            )
        if not _is(node, _TAKES):
            return None
        node = node.args[0]
    return None


def _same_memory(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def _is(node: object, targets: tuple) -> bool:
    return isinstance(node, Node) and node.op in ("call_function", "call_method") and node.target in targets
