"""What an attention ``forward`` does besides projecting, statement by statement: which
statements the vLLM rewrite may drop (their meaning is in the plan or vLLM's layers), which it
carries (config-switched in-place clamps), which it must refuse. Used by
``passes/vllm_attention.py``."""

from __future__ import annotations

import libcst as cst

from hfrewrite.emit import cst_tools as t

# What an attention forward may do besides projecting, for the rewrite to be faithful:
# reshape q/k/v, apply the plan's per-head norms, the rope helper, the HF cache update, the
# attention interface and the output projection. Anything else is refused (fail closed).
LAYOUT_METHODS = {"view", "transpose", "reshape", "contiguous", "flatten", "unsqueeze"}
ALLOWED_CALLS = LAYOUT_METHODS | {
    "attention_interface",
    "get_interface",
    "getattr",
}
# dropout after the output projection: the analysis proved it the identity at inference
DROPOUT_CALLS = {"dropout"}
# torch's tensor factories: free of effects; what they build (a causal mask over concrete
# lengths) reaches the output only through the attention call the analysis proved
FACTORIES = {"ones", "zeros", "full", "empty", "arange", "tril", "triu", "bool", "sqrt", "finfo"}


class _Calls(cst.CSTVisitor):
    def __init__(self) -> None:
        self.names: list[str] = []

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        self.names.append(func.attr.value if isinstance(func, cst.Attribute) else t.dotted(func) or "?")


# In-place elementwise ops on q/k/v that a config can switch on (olmoe's clip_qkv): the
# source's `if` is carried over verbatim, with q/k/v renamed to vLLM's names.
_INPLACE_ELEMENTWISE = {"clamp_", "clip_"}


def state_names(body: list[cst.BaseStatement]) -> dict[str, str]:
    """HF names of the q/k/v tensors -> "q"/"k"/"v" (`query_states = q.view(...)` ...)."""
    names = {"q": "q", "k": "k", "v": "v"}
    for statement in body:
        if isinstance(statement, cst.SimpleStatementLine) and isinstance(statement.body[0], cst.Assign):
            assign = statement.body[0]
            sources = {names[n] for n in t.names_used(assign.value) if n in names}
            targets = [
                e.value
                for tgt in assign.targets
                for e in (
                    tgt.target.elements if isinstance(tgt.target, cst.Tuple) else [cst.Element(tgt.target)]
                )
                if isinstance(e.value, cst.Name)
            ]
            if len(sources) == 1 and len(targets) == 1:
                names[targets[0].value] = sources.pop()
    return names


def carried_conditional(statement: cst.BaseStatement, states: dict[str, str]) -> cst.If | None:
    """`if <config test>: q.clamp_(...)`-style statement, renamed to q/k/v, or None."""
    if not isinstance(statement, cst.If) or statement.orelse is not None:
        return None
    if t.names_used(statement.test) & set(states):
        return None
    for line in statement.body.body:
        call = (
            line.body[0].value
            if isinstance(line, cst.SimpleStatementLine) and isinstance(line.body[0], cst.Expr)
            else None
        )
        if not (
            isinstance(call, cst.Call)
            and isinstance(call.func, cst.Attribute)
            and isinstance(call.func.value, cst.Name)
            and call.func.value.value in states
            and call.func.attr.value in _INPLACE_ELEMENTWISE
            and not (
                t.names_used(
                    cst.Module([cst.SimpleStatementLine([cst.Expr(a.value) for a in call.args])])
                    if call.args
                    else set()
                )
                & set(states)
            )
        ):
            return None

    class _Rename(cst.CSTTransformer):
        def leave_Name(self, original, updated):
            return updated.with_changes(value=states.get(updated.value, updated.value))

    return statement.visit(_Rename())


def cache_update(statement: cst.BaseStatement, params: set[str]) -> bool:
    """``if <cache> is not None: k, v = <cache>.update(...)``, ``<cache>`` a forward
    parameter (Hugging Face's KV cache): vLLM's Attention owns the cache, so it goes."""
    if not isinstance(statement, cst.If) or statement.orelse is not None:
        return False
    caches = t.root_names(statement.test) & params
    return bool(caches) and all(
        isinstance(s, cst.SimpleStatementLine)
        and len(s.body) == 1
        and isinstance(s.body[0], cst.Assign)
        and isinstance(s.body[0].value, cst.Call)
        and isinstance(s.body[0].value.func, cst.Attribute)
        and t.code(s.body[0].value.func.value) in caches
        and s.body[0].value.func.attr.value == "update"
        for s in statement.body.body
    )


def attention_branches(statement: cst.BaseStatement, allowed_calls: set[str]) -> bool:
    """``if <not a config switch>: ... else: ...`` whose branches only make the calls the
    plan accounts for: the source picking its causal attention by shapes or cache (prefill
    traced and proven, decode checked by convert-time validation); vLLM's replaces both."""
    if not isinstance(statement, cst.If) or t.root_names(statement.test) & _SWITCH_NAMES - {"None"}:
        return False
    branches = [statement.body.body]
    if isinstance(statement.orelse, cst.Else):
        branches.append(statement.orelse.body.body)
    elif statement.orelse is not None:
        return False  # elif chains: not this shape
    return all(not unrecognised(s, allowed_calls) for body in branches for s in body)


def unrecognised(statement: cst.BaseStatement, allowed_calls: set[str]) -> bool:
    """True for a statement the vLLM rewrite would silently drop the meaning of."""
    if isinstance(statement, cst.If):
        return True  # the caller sorts out the ifs it knows
    if not isinstance(statement, cst.SimpleStatementLine):
        return True
    calls = _Calls()
    statement.visit(calls)
    return any(c not in allowed_calls for c in calls.names)


# What a config switch may read: the module's own attributes and constants.
_SWITCH_NAMES = {"self", "config", "None", "True", "False"}


def config_switch(statement: cst.BaseStatement) -> cst.BaseExpression | None:
    """The test of ``if <self/config test>: ...`` (no else), else None."""
    if (
        isinstance(statement, cst.If)
        and statement.orelse is None
        and t.root_names(statement.test) <= _SWITCH_NAMES
    ):
        return statement.test
    return None


def guards_rope(statement: cst.If, allowed_calls: set[str], states: dict[str, str]) -> bool:
    """The body only re-assigns q/k states through the allowed (rope and layout) calls:
    the position-dependent region the analysis proved is the rope, under a condition."""
    assigned = {
        name
        for s in statement.body.body
        if isinstance(s, cst.SimpleStatementLine)
        for small in s.body
        if isinstance(small, cst.Assign)
        for target in small.targets
        for name in t.root_names(target.target)
    }
    return all(not unrecognised(s, allowed_calls) for s in statement.body.body) and bool(
        {states.get(name) for name in assigned} & {"q", "k"}
    )
