"""The lm_head: ``nn.Linear``, or a module of its own holding one weight (Baichuan2's
``NormHead``, ERNIE-4.5's ``LMHead``) whose logits the replay proves are ``x @ W.T`` or
``x @ normalize(W, dim=-1).T`` with ``W`` ``[vocab, hidden]``, or ``x @ W`` with ``W``
``[hidden, vocab]``. vLLM's ``ParallelLMHead`` computes the first; the others are the first on
a weight normalised, or transposed, once when it is loaded.

A head class may build its weight per config: the model is built once more with the other
``tie_word_embeddings``, and the head proven there too. ERNIE-4.5 keeps ``[vocab, hidden]``
when tied (the embedding's weight) and ``[hidden, vocab]`` when not."""

from __future__ import annotations

import torch
from torch import nn

from hfrewrite.analyze.linear_classes import is_linear
from hfrewrite.analyze.plan import refuse

LINEAR = ""  # nn.Linear itself
PLAIN = "plain"  # its own class computing x @ W.T
L2_NORMALIZED = "l2_normalized"  # x @ normalize(W, dim=-1).T
TRANSPOSED = "transposed"  # x @ W, W [hidden, vocab]
TRANSPOSED_WHEN_UNTIED = "transposed_when_untied"  # PLAIN when tied, TRANSPOSED when not
EMBEDDING = "embedding"  # no head module: the token embedding's weight, by a call (functional_head.py)


def is_head(module: nn.Module, config) -> bool:
    if isinstance(module, nn.Linear):
        return module.out_features == config.vocab_size
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    return (
        not list(module.children())
        and set(params) == {"weight"}
        and weight.dim() == 2
        and config.vocab_size in weight.shape
    )


def head_kind(module: nn.Module, x, out, config, flipped: nn.Module | None) -> str:
    """How the head computes its logits, proven on the example run's values; ``flipped`` is
    the head of the model built with the other ``tie_word_embeddings`` (None: it does not
    build), replayed on the same input."""
    if is_linear(module):
        return LINEAR
    kind = _kind(module, x, out, config)
    if flipped is None or not is_head(flipped, config):
        return kind
    with torch.no_grad():
        other = _kind(flipped, x, flipped(x), config)
    tied, untied = (kind, other) if getattr(config, "tie_word_embeddings", False) else (other, kind)
    if tied == untied:
        return kind
    if (tied, untied) == (PLAIN, TRANSPOSED):
        return TRANSPOSED_WHEN_UNTIED
    refuse(
        "lm_head",
        f"the head computes {tied} logits when tied and {untied} ones when untied",
        type(module).__name__,
    )


def _kind(module: nn.Module, x, out, config) -> str:
    cls = type(module).__name__
    w = module.weight.detach().double()
    hidden = getattr(config, "hidden_size", None)
    if hidden not in w.shape:
        refuse("lm_head", "no config.hidden_size gives the head's width", cls)
    x = x.detach().double()
    if not (torch.is_tensor(out) and x.abs().max() > 1e-3):  # near-zero inputs prove nothing
        refuse("lm_head", "the example run's head input is all but zero: its logits prove nothing", cls)
    candidates = []
    if w.shape == (config.vocab_size, hidden):
        candidates += [(PLAIN, w.T), (L2_NORMALIZED, torch.nn.functional.normalize(w, dim=-1).T)]
    if w.shape == (hidden, config.vocab_size):
        candidates.append((TRANSPOSED, w))
    kinds = [k for k, weight in candidates if torch.allclose(out.double(), x @ weight, rtol=1e-4, atol=1e-5)]
    if len(kinds) == 1:
        return kinds[0]
    if kinds:
        refuse("lm_head", f"{' and '.join(kinds)} logits agree on the example's weight", cls)
    refuse("lm_head", "its logits are none of x @ W.T, x @ normalize(W).T, x @ W (replayed)", cls)
