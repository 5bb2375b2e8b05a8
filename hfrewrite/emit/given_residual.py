"""The tensor an attention block adds to its output projection before returning (BLOOM's
``dropout_add(output, residual, ...)``; the analysis proved the block returns the projection
plus a tensor it was given: ``AttentionPlan.adds_residual``). The source forward's parameter
holding it is the one the statements after the projection read."""

from __future__ import annotations

import libcst as cst

from hfrewrite.emit import cst_tools as t
from hfrewrite.errors import HfrewriteError


def projection_at(body: list[cst.BaseStatement], attr: str) -> int:
    """Index of the last top-level statement that calls ``self.<attr>``, or -1."""
    calls = [
        i
        for i, s in enumerate(body)
        if any(isinstance(n, cst.Call) and t.call_name(n) == f"self.{attr}" for n in t.walk(s))
    ]
    return calls[-1] if calls else -1


def residual_param(forward: cst.FunctionDef, attr: str, cls: str) -> str:
    """The one parameter of ``forward`` that the statements after its ``self.<attr>`` call read."""
    body = list(forward.body.body)
    at = projection_at(body, attr)
    params = {p.name.value for p in (*forward.params.params, *forward.params.kwonly_params)} - {"self"}
    read = sorted(set().union(*(t.root_names(s) for s in body[at + 1 :])) & params) if at >= 0 else []
    if len(read) != 1:
        raise HfrewriteError(
            f"{cls}: the tensor added after self.{attr} is not one parameter of forward (reads {read or 'none'})"
        )
    return read[0]
