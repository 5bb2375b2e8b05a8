"""Which lines of a module's forward the trace ran: the branch of an ``if`` on the calling
convention (``is_cross_attention = encoder_hidden_states is not None``) that the traced call
took is the one whose lines made nodes (passes/taken_branches.py keeps it)."""

from __future__ import annotations

import inspect

from hfrewrite.analyze.trace import Traced


def traced_lines(traced: Traced, path: str) -> tuple[str, ...]:
    """The source lines (whitespace-normalised) of the forward of the module at ``path``
    where the trace recorded a node."""
    forward = inspect.unwrap(type(traced.module.get_submodule(path)).forward)
    try:
        source, start = inspect.getsourcelines(forward)
    except (OSError, TypeError):
        return ()
    code = forward.__code__
    ran = {n.meta["lines"][code] for n in traced.graph.nodes if code in n.meta.get("lines", {})}
    return tuple(
        sorted({" ".join(source[at - start].split()) for at in ran if 0 <= at - start < len(source)})
    )
