"""Plain functions a module holds as attributes that compute nothing: they return their
arguments unchanged (Falcon-RW's ``self.maybe_rotary = lambda q, k: (q, k)`` when its
config turns rope off). Proven by replay on opaque objects; the attention rewrite may drop
their calls."""

from __future__ import annotations

import inspect


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
