"""A config switch around a GQA expansion of k and v, which vLLM's attention makes redundant."""

from __future__ import annotations

import libcst as cst

from hfrewrite.emit import cst_tools as t

# the calls a GQA expansion of k and v makes (torch's own; a repeat_kv helper the analysis proved)
_EXPANSIONS = {"repeat_interleave", "repeat", "expand", "repeat_kv"}


def kv_expansion(statement: cst.BaseStatement, allowed_calls: set[str], states: dict[str, str]) -> bool:
    """``if <test>: k = k.repeat_interleave(g, dim=1); v = ...`` (OpenELM's ``if
    self.num_groups != 1:``): a body that only expands k and v to every query head, which
    vLLM's attention does itself whatever the test gives (the analysis took k and v before
    the expansion). ``allowed_calls``: those the plan accounts for; ``states``: names -> role."""
    if not isinstance(statement, cst.If) or statement.orelse is not None:
        return False
    body = statement.body.body
    if not all(isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 for s in body):
        return False
    assigns = [s.body[0] for s in body]
    if not all(isinstance(a, cst.Assign) and len(a.targets) == 1 for a in assigns):
        return False
    targets = {name for a in assigns for name in t.root_names(a.targets[0].target)}
    calls = [t.call_name(n) or "" for n in t.walk(statement.body) if isinstance(n, cst.Call)]
    called = {c.rsplit(".", 1)[-1] for c in calls}
    return (
        bool(called)
        and all(calls)
        and called <= _EXPANSIONS & allowed_calls
        and bool(targets)
        and {states.get(name) for name in targets} <= {"k", "v"}
    )
