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
    """The one parameter of ``forward`` that the first statement after its ``self.<attr>``
    call to read the projection's output reads beside it (not the caches and flags that later
    statements return or test)."""
    body = list(forward.body.body)
    at = projection_at(body, attr)
    params = {p.name.value for p in (*forward.params.params, *forward.params.kwonly_params)} - {"self"}
    outputs = _assigned(body[at]) if at >= 0 else set()
    combining = next((s for s in body[at + 1 :] if t.root_names(s) & outputs), None) if outputs else None
    after = [combining] if combining is not None else body[at + 1 :] if at >= 0 else []
    read = sorted(set().union(set(), *(t.root_names(s) for s in after)) & params)
    if len(read) != 1:
        raise HfrewriteError(
            f"{cls}: the tensor added after self.{attr} is not one parameter of forward (reads {read or 'none'})"
        )
    return read[0]


def _assigned(statement: cst.BaseStatement) -> set[str]:
    """The plain names a statement assigns (``x = ...``, ``x, _ = ...``)."""
    targets = [n.target for n in t.walk(statement) if isinstance(n, cst.AssignTarget)]
    return {n.value for target in targets for n in t.walk(target) if isinstance(n, cst.Name)}
