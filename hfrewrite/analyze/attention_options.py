"""The keywords of an attention call that vLLM's ``Attention`` takes (the scale, the soft
cap, the window, per-head sinks), read off the traced call; any other keyword that changes
the math is refused."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.fx import Node

from hfrewrite.analyze.causal_mask import allows_exactly
from hfrewrite.analyze.mask_window import band
from hfrewrite.analyze.plan import refuse
from hfrewrite.analyze.trace import causal_sdpa, relative, value

# Keywords of the attention call that do not change its math (at inference); any other
# keyword must be None or False (flags like output_router_logits pass through **kwargs).
HARMLESS_KWARGS = frozenset(
    {
        "dropout",
        "scaling",
        "sliding_window",
        "position_ids",
        "use_cache",
        "cache_position",
        "past_key_values",
        "output_attentions",
        "softcap",  # vLLM Attention(logits_soft_cap=...), from the same expression
    }
)


class CallOptions(NamedTuple):
    """The attention call's keywords vLLM's ``Attention`` takes (traced values, None: not passed)."""

    sinks: str | None  # the attention's per-head sinks parameter
    scaling: float | None
    softcap: float | None
    window: int | None
    chunk: int | None = None  # the keys are those of the query's chunk of this many tokens


def call_options(call: Node, path: str, num_heads: int) -> CallOptions:
    """The attention call's keywords; refuses any other that changes the math."""
    sinks = _sinks(call, path, num_heads)
    proven = {"s_aux"} if sinks else set()
    proven |= {"alibi"} if call.target is causal_sdpa else set()  # the fold's own proven fact
    for key in sorted(set(call.kwargs) - HARMLESS_KWARGS - proven):
        passed = value(call.kwargs[key])
        if passed is not None and passed is not False:
            tensor = torch.is_tensor(passed)
            shown = f"<{tuple(passed.shape)} tensor>" if tensor else repr(passed)
            reason = f"the attention call passes {key}={shown}"
            refuse("vllm_attention", reason)
    if value(call.kwargs.get("dropout", 0.0)):
        refuse("vllm_attention", "attention dropout is not 0 at inference")
    softcap = value(call.kwargs.get("softcap"))
    scaling = value(call.kwargs.get("scaling"))
    if (
        call.target is causal_sdpa
        and scaling is not None
        and call.meta.get("by_hand")
        and not call.meta["unscaled"]
    ):
        refuse(
            "vllm_attention",
            f"computes a softmax attention by hand at another scale than the default (its "
            f"scores are scaled by {scaling:.6g}, not head_dim ** -0.5)",
        )
    if call.target is causal_sdpa and scaling is not None and not call.meta.get("unscaled"):
        refuse("vllm_attention", "torch's scaled_dot_product_attention is called with an explicit scale")
    window = value(call.kwargs.get("sliding_window"))
    chunk = _prove_layer_mask(call, window)
    return CallOptions(sinks, scaling, softcap, window, chunk)


def _prove_layer_mask(call: Node, window: int | None) -> int | None:
    """The mask handed to the attention call (the example run's: one unpadded sequence) lets
    each token see what vLLM's ``Attention`` lets it see: the keys up to it, the last
    ``window`` of them where the call passes a sliding window, or (returned) the keys of its
    own chunk of so many tokens (Llama-4's chunked attention, whose chunks the shrunk config
    makes shorter than the example: vLLM's ``ChunkedLocalAttention``). Any other mask is
    refused: vLLM's causal attention would compute something else."""
    mask = value(call.args[4]) if len(call.args) > 4 else None
    if not torch.is_tensor(mask) or mask.dim() < 2:
        return None  # None: the implementation's own causal attention
    length = mask.shape[-1]
    if mask.shape[-2] != length:
        return None  # queries over a longer key range (a cache): not the example's prefill
    if window is None:
        chunk = next((c for c in range(1, length) if allows_exactly(mask, chunked_band(length, c))), None)
        if chunk is not None:
            return chunk
    if not allows_exactly(mask, band(length, window)):
        refuse(
            "vllm_attention",
            "the mask the attention call is given is not causal"
            + (f" within the call's sliding window of {window}" if window else "")
            + " (checked on the example run's mask: chunked, local or computed from the values), "
            "which vLLM's Attention would not compute",
        )
    return None


def chunked_band(length: int, chunk: int) -> torch.Tensor:
    """Causal attention within chunks of ``chunk`` positions (0..chunk-1, chunk..)."""
    position = torch.arange(length)
    return band(length, None) & (position[:, None] // chunk == position[None, :] // chunk)


def _sinks(call: Node, path: str, num_heads: int) -> str | None:
    """The attention module's parameter passed as ``s_aux`` (transformers' attention
    interface: one sink logit per head joining each softmax, gpt_oss), which vLLM's
    ``Attention(sinks=...)`` takes; None when the call passes none."""
    passed = call.kwargs.get("s_aux")
    if passed is None or value(passed) is None:
        return None
    if not (
        isinstance(passed, Node)
        and passed.op == "get_attr"
        and str(passed.target).startswith(f"{path}.")
        and "." not in relative(str(passed.target), path)
        and value(passed).shape == (num_heads,)
    ):
        refuse(
            "vllm_attention", "the attention sinks (s_aux) are not one per-head parameter of the attention"
        )
    return relative(str(passed.target), path)
