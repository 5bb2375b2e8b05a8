"""What an attention forward calls that computes nothing: plain functions a module holds as
attributes that return their arguments unchanged (Falcon-RW's ``self.maybe_rotary = lambda
q, k: (q, k)`` when its config turns rope off), proven by replay on opaque objects, and
dropouts traced as identities after the output projection. The attention rewrite may drop
their calls."""

from __future__ import annotations

import inspect

import torch
from torch.fx import Node


def identity_attributes(module) -> list[str]:
    """The names of ``module``'s instance attributes that are such functions."""
    found = []
    for name, member in vars(module).items():
        if not inspect.isfunction(member):
            continue
        params = inspect.signature(member).parameters.values()
        if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
            continue
        args = [object() for _ in params]
        try:
            out = member(*args)
        except Exception:  # noqa: BLE001, S112 - it does something with its arguments
            continue
        if (isinstance(out, tuple) and list(map(id, out)) == list(map(id, args))) or (
            len(args) == 1 and out is args[0]
        ):
            found.append(name)
    return found


def identity_dropouts(traced, scope: set[Node], o_node: Node) -> set[Node]:
    """Dropouts traced with ``training=False`` (identities) on the output projection's value,
    in a chain (gpt_bigcode's ``self.resid_dropout(self.c_proj(x))``)."""
    found, last = set(), o_node
    for n in traced.graph.nodes:
        if (
            n in scope
            and n.target is torch.nn.functional.dropout
            and n.kwargs.get("training", True) is False
            and n.args[:1] == (last,)
        ):
            found.add(n)
            last = n
    return found
