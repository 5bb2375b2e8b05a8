"""Which module's weight the lm_head shares when the config ties them, found by identity.

The shrunk config is built once more with ``tie_word_embeddings=True``; transformers ties the
weights the model's own code names (``_tied_weights_keys``, in its 4.x list form or 5.x dict
form). The module whose ``weight`` *is* the head's is the tie target, whatever the source
spells; no shared weight: the head is never tied.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def tied_target(small, build, head: str) -> str | None:
    """The module path (``model.embed_tokens``) whose weight is the lm_head's own when the
    config ties them, or None; ``build`` builds a causal LM from a config."""
    tied = copy.deepcopy(small)
    tied.tie_word_embeddings = True
    try:
        model = build(tied)
    except Exception:  # noqa: BLE001 - this config cannot build tied: the source never ties
        return None
    weight = getattr(model.get_submodule(head), "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    shared = [
        name
        for name, module in model.named_modules()
        if name != head and isinstance(module, nn.Embedding) and module.weight is weight
    ]
    return shared[0] if len(shared) == 1 else None
