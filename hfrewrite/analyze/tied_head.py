"""The lm_head under the other ``tie_word_embeddings``, and which module's weight it shares
when the config ties them, found by identity.

The shrunk config is built once more with ``tie_word_embeddings`` flipped; tied, transformers
ties the weights the model's own code names (``_tied_weights_keys``, in its 4.x list form or
5.x dict form). The module whose ``weight`` *is* the head's is the tie target, whatever the
source spells; no shared weight: the head is never tied.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from hfrewrite.analyze.lm_head import TRANSPOSED_WHEN_UNTIED


def flipped_tie(small, build) -> nn.Module | None:
    """The causal LM built from ``small`` with ``tie_word_embeddings`` flipped, or None where
    that config does not build; ``build`` builds a causal LM from a config."""
    other = copy.deepcopy(small)
    other.tie_word_embeddings = not getattr(small, "tie_word_embeddings", False)
    try:
        return build(other).eval()
    except Exception:  # noqa: BLE001 - this config cannot build the other way: the source never does
        return None


def tied_target(tied: nn.Module | None, head: str) -> str | None:
    """The module path (``model.embed_tokens``) whose weight is the lm_head's own in ``tied``,
    the model built tied, or None."""
    if tied is None:
        return None
    weight = getattr(tied.get_submodule(head), "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    shared = [
        name
        for name, module in tied.named_modules()
        if name != head and isinstance(module, nn.Embedding) and module.weight is weight
    ]
    return shared[0] if len(shared) == 1 else None


def head_sibling(config, kind: str) -> tuple:
    """The sibling config with the other ``tie_word_embeddings`` when the head's layout
    depends on it: validated both ways."""
    if kind != TRANSPOSED_WHEN_UNTIED:
        return ()
    other = copy.deepcopy(config)
    other.tie_word_embeddings = not getattr(config, "tie_word_embeddings", False)
    return ((f"tie_word_embeddings={other.tie_word_embeddings} (the head's other layout)", other),)
