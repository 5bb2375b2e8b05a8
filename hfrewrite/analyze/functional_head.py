"""A causal LM with no lm_head module: its logits computed with the token embedding's own
weight by a function call (OpenELM's ``F.linear(hidden_states, weight=token_embeddings.weight)``
under ``share_input_output_layers``).

The head is then the embedding's weight: the file builds vLLM's ``ParallelLMHead`` under the
name ``lm_head`` and ties it to the embedding, as for any tied head. That the logits are the
final hidden states times that weight is proven on the example run: the one ``F.linear`` call
whose weight is the embedding's, and whose output is the model's logits (example_run.py).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

# the name the file gives the head it builds
HEAD = "lm_head"


def embedding_head(model: nn.Module, base: str, embeds: list[str], vocab: int) -> str | None:
    """The dotted path of the one token embedding (``[vocab, hidden]``, under the base model
    at ``base``) whose weight could be the head's, where ``model`` holds no module named like
    the head the file builds; else None."""
    if HEAD in dict(model.named_children()):
        return None
    found = [
        f"{base}.{name}"
        for name in embeds
        if isinstance(m := model.get_submodule(f"{base}.{name}"), nn.Embedding) and m.weight.shape[0] == vocab
    ]
    return found[0] if len(found) == 1 else None


def stand_in(model: nn.Module, embedding: str) -> nn.Linear:
    """An ``nn.Linear`` computing what the source's call computes, sharing the embedding's weight
    (never added to ``model``): what the head analysis reads."""
    weight = model.get_submodule(embedding).weight
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight = weight
    return head


@contextlib.contextmanager
def recording_linear(target: torch.Tensor, calls: dict, key: str):
    """While active, each ``F.linear`` call with the weight ``target`` (and no bias) is
    recorded into ``calls[key]`` as ``((input,), output)``, the last one kept."""
    functional = torch.nn.functional
    original = functional.linear

    def linear(input, weight, bias=None):  # torch's own parameter names: callers pass them
        out = original(input, weight, bias)
        if weight is target and bias is None:
            calls[key] = ((input.detach().clone(),), out.detach().clone())
        return out

    functional.linear = linear
    try:
        yield
    finally:
        functional.linear = original
