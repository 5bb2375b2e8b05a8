"""Drop parameters nothing reads any more, and the arguments passed to them.

Matches a parameter of a top-level function, or of a top-level class's ``__init__``, that
its body never reads, once the earlier passes have rewritten the body (``layer_idx`` of an
attention class whose KV-cache bookkeeping became vLLM's ``Attention``, ``padding_idx`` of
an embedding that became ``VocabParallelEmbedding``) or because the source never read it.

Emits the definition without the parameter, and every call without the argument bound to
it (by keyword or by position). Repeats until nothing changes: a decoder layer that only
handed ``layer_idx`` to its attention loses it next. Attributes left unread by a dropped
argument (``self.padding_idx``) then go as in ``strip_hf_runtime``.

Preconditions (otherwise the parameter stays): the function or class is referenced only
as the callee of direct calls in the module (not subclassed, stored or passed around);
no call unpacks ``*args``/``**kwargs``; each dropped argument is free of side effects
(names, attributes, constants, subscripts, or ``extract_layer_index(...)``); the body
does not call ``locals()``/``vars()``/``eval``.
"""

from __future__ import annotations

import libcst as cst
from hfrewrite.passes import strip_hf_runtime

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pass_api import PassContext, PassResult
from hfrewrite.emit.pure_expressions import computes_only

NAME = "prune_unused_params"
# Calls of the emitted code that only compute a value (vLLM's layer-index parser).
PURE_CALLS = frozenset({"extract_layer_index"})
_INTROSPECTION = frozenset({"locals", "vars", "eval", "exec"})


def _unused(fn: cst.FunctionDef, is_init: bool) -> list[str]:
    used = t.names_used(fn.body)
    if used & _INTROSPECTION:
        return []
    params = [
        *t.positional_params(fn, is_init),
        *(p.name.value for p in fn.params.kwonly_params),
    ]
    return [p for p in params if p not in used]


def _droppable(fn, is_init, param, calls) -> dict[int, int] | None:
    """id(call) -> index of the argument to drop (-1: none passed), if every call allows it."""
    plan = {}
    for call in calls:
        at = t.bound_arg(call, fn, is_init, param)
        if at is None or (at >= 0 and not computes_only(call.args[at].value, PURE_CALLS)):
            return None
        plan[id(call)] = at
    return plan


class _Drop(cst.CSTTransformer):
    """Removes ``param`` from ``callee``'s definition and the planned argument of each call."""

    def __init__(self, callee: str, param: str, plan: dict[int, int]) -> None:
        self.callee, self.param, self.plan = callee, param, plan
        self.in_callee: list[bool] = []

    def visit_ClassDef(self, node):
        self.in_callee.append(node.name.value == self.callee)

    def leave_ClassDef(self, original, updated):
        self.in_callee.pop()
        return updated

    def leave_FunctionDef(self, original, updated):
        top = len(self.in_callee) == 0 and original.name.value == self.callee
        init = bool(self.in_callee) and self.in_callee[-1] and original.name.value == "__init__"
        if not (top or init):
            return updated
        params = updated.params
        return updated.with_changes(
            params=params.with_changes(
                params=[p for p in params.params if p.name.value != self.param],
                kwonly_params=[p for p in params.kwonly_params if p.name.value != self.param],
            )
        )

    def leave_Call(self, original, updated):
        at = self.plan.get(id(original), -1)
        if at < 0:
            return updated
        args = [a for i, a in enumerate(updated.args) if i != at]
        if args and at == len(updated.args) - 1:  # the new last argument keeps no comma
            args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return updated.with_changes(args=args)


def _next_drop(module: cst.Module) -> _Drop | None:
    calls = t.direct_calls(module)
    for name, fn in t.callable_defs(module).items():
        if name not in calls:  # referenced other than by direct calls
            continue
        is_init = fn.name.value == "__init__"
        for param in _unused(fn, is_init):
            plan = _droppable(fn, is_init, param, calls[name])
            if plan is not None:
                return _Drop(name, param, plan)
    return None


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    dropped = 0
    while (drop := _next_drop(module)) is not None:
        module = module.visit(drop)
        dropped += 1
    if dropped:  # an argument that was the last reader of `self.x` orphans that attribute
        module = strip_hf_runtime.without_orphans(module, ctx.plan.architecture)
    return PassResult(module=module, matches=dropped)
