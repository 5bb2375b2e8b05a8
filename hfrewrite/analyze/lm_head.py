"""The lm_head: ``nn.Linear``, or a module of its own holding one ``[vocab, hidden]``
weight (Baichuan2's ``NormHead``) whose logits the replay proves are ``x @ W.T`` or
``x @ normalize(W, dim=-1).T``: vLLM's ``ParallelLMHead`` computes the first; the second
is the first on a weight normalised once, when it is loaded."""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch
from torch import nn

from hfrewrite.analyze.linear_classes import is_linear
from hfrewrite.analyze.plan import refuse

LINEAR = ""  # nn.Linear itself
PLAIN = "plain"  # its own class computing x @ W.T
L2_NORMALIZED = "l2_normalized"  # x @ normalize(W, dim=-1).T


def is_head(module: nn.Module, config) -> bool:
    if isinstance(module, nn.Linear):
        return module.out_features == config.vocab_size
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    return (
        not list(module.children())
        and set(params) == {"weight"}
        and weight.dim() == 2
        and weight.shape[0] == config.vocab_size
    )


def head_kind(module: nn.Module, x, out, config) -> str:
    """How the head computes its logits, proven on the example run's values."""
    if is_linear(module):
        return LINEAR
    cls = type(module).__name__
    if _branches_in_init(type(module)):
        refuse("lm_head", "the head class builds its weight differently per config", cls)
    if getattr(config, "hidden_size", None) != module.weight.shape[1]:
        refuse("lm_head", "no config.hidden_size gives the head's width", cls)
    w = module.weight.detach().double()
    x = x.detach().double()
    if not (torch.is_tensor(out) and x.abs().max() > 1e-3):  # near-zero inputs prove nothing
        refuse("lm_head", "the example run's head input is all but zero: its logits prove nothing", cls)
    candidates = ((PLAIN, w), (L2_NORMALIZED, torch.nn.functional.normalize(w, dim=-1)))
    kinds = [
        k for k, weight in candidates if torch.allclose(out.double(), x @ weight.T, rtol=1e-4, atol=1e-5)
    ]
    if len(kinds) == 1:
        return kinds[0]
    if kinds:
        refuse("lm_head", "x @ W.T and x @ normalize(W).T agree on the example's weight", cls)
    refuse("lm_head", "its logits are neither x @ W.T nor x @ normalize(W).T (replayed)", cls)


def _branches_in_init(cls: type) -> bool:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    except (OSError, TypeError, SyntaxError):
        return True
    return any(isinstance(n, ast.If | ast.IfExp) for n in ast.walk(tree))
