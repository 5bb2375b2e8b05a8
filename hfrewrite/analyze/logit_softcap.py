"""A final-logit soft cap, proven on the values: the logits are ``c * tanh(head / c)`` where
``c`` is one float field of the config, read when the model runs.

The example run showed that the logits differ from the lm_head's output. Here the model
runs again with each float field of its config changed to a cap that visibly bends these
logits: exactly one field must then cap them (the cap follows the field, not a constant
equal to it). That field must also cap them at its own value, and at ``None`` leave them
as the head returned them, as vLLM's ``LogitsProcessor(soft_cap=None)`` does. Only then
does the file hand the field to ``LogitsProcessor(soft_cap=...)``; otherwise it carries
the source's statements.
"""

from __future__ import annotations

import torch
from torch import nn

from hfrewrite.analyze.shrink import VOCAB


def softcap_field(model: nn.Module, head: str) -> str | None:
    """The config field that soft-caps the logits, proven as above; else None."""
    config = model.config
    head_out, _ = _run(model, head)
    if head_out is None or not head_out.abs().max() > 0:
        return None
    bite = float(head_out.abs().max()) / 2  # a cap that bends these logits visibly
    fields = [name for name, value in sorted(vars(config).items()) if isinstance(value, float) and value > 0]
    found = [f for f in fields if _caps_at(model, head, f, bite)]
    if len(found) != 1:
        return None
    field = found[0]
    own = getattr(config, field)
    if all(_caps_at(model, head, field, cap) for cap in (own, None)):
        return field
    return None


def _caps_at(model: nn.Module, head: str, field: str, cap: float | None) -> bool:
    """With ``config.<field> = cap``, the model's logits are its head's output capped by it."""
    config = model.config
    own = getattr(config, field)
    try:
        setattr(config, field, cap)
        head_out, logits = _run(model, head)
    except Exception:  # noqa: BLE001 - the source cannot run with the field changed: unproven
        return False
    finally:
        setattr(config, field, own)
    return head_out is not None and _capped(head_out, logits, cap)


def _run(model: nn.Module, head: str) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The lm_head's output and the logits of one run on example ids."""
    seen: list[torch.Tensor] = []
    hook = getattr(model, head).register_forward_hook(lambda _, args, out: seen.append(out))
    ids = torch.arange(10).reshape(2, 5) % VOCAB
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
    finally:
        hook.remove()
    out = seen[-1] if seen else None
    return (out if torch.is_tensor(out) else None), logits


def _capped(head_out: torch.Tensor, logits: torch.Tensor, cap: float | None) -> bool:
    """``logits`` is ``cap * tanh(head_out / cap)`` (``head_out`` itself for ``None``)."""
    if head_out.shape != logits.shape:
        return False
    if cap is None:
        return torch.equal(head_out, logits)
    return torch.allclose(cap * torch.tanh(head_out / cap), logits, rtol=1e-5, atol=1e-6)
