"""Build a base model's nested parts in the base model itself.

Matches the base model of a plan with ``flat_holders`` (ChatGLM3's ``self.embedding =
init_method(Embedding, config, **init_kwargs)`` and ``self.encoder = ...(GLMTransformer,
...)``, whose ``__init__`` builds the word embeddings, the decoder layers and the final norm),
and the lm_head its ``__init__`` builds when the plan has ``flat_head``.

Emits, in the base model's ``__init__``, each holder's ``__init__`` statements in place of the
holder (its parameters bound to the call's arguments, or their defaults; ``self.<attr>`` of
the holder in tests read as what the holder's ``__init__`` assigns it), so that the later
passes find the parts where they look for them; the lm_head's statement moves to the causal
LM's ``__init__``. A holder may be built through a wrapper taking its class first
(``skip_init(Cls, ...)``, which only skips the initialisation): the analysis traced the class
itself. Locals the base model's ``__init__`` then no longer reads go.

Preconditions: each holder is built once, with names or literals as arguments; a statement
moved in does not rebind what the base model's ``__init__`` already binds otherwise.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult
from hfrewrite.emit.shared_matchers import SUPER_INIT_CALL
from hfrewrite.errors import HfrewriteError

NAME = "flatten_base_model"


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    plan = ctx.plan
    if not plan.flat_holders:
        return PassResult(module=module)
    base = t.find_class(module, plan.base_model_class)
    init = t.find_method(base, "__init__")
    body = list(init.body.body)
    rows = []
    for attr, cls in plan.flat_holders:
        at = [i for i, s in enumerate(body) if t.self_attr_assigned(s) == attr]
        if len(at) != 1:
            raise HfrewriteError(f"{base.name.value}: {NAME}: self.{attr} is not built once in __init__")
        hoisted = _holder_body(t.find_class(module, cls), _holder_args(t.assigned_value(body[at[0]]), cls))
        body[at[0] : at[0] + 1] = _merged(body, hoisted, base.name.value)
        rows.append(FusionRow(base.name.value, f"{attr} ({cls}) built flat: its parts are the base model's"))
    head: list[cst.BaseStatement] = []
    if plan.flat_head:
        head = [_unwrapped(s, plan.flat_head) for s in body if t.self_attr_assigned(s) == plan.lm_head]
        body = [s for s in body if t.self_attr_assigned(s) != plan.lm_head]
        if len(head) != 1:
            raise HfrewriteError(f"{base.name.value}: {NAME}: self.{plan.lm_head} is not built once")
    module = t.replace_class(
        module, plan.base_model_class, t.set_method(base, t.with_body(init, _live(body)))
    )
    if head:
        causal = t.find_class(module, plan.architecture)
        cinit = t.find_method(causal, "__init__")
        cbody = list(cinit.body.body)
        at = next(i for i, s in enumerate(cbody) if t.self_attr_assigned(s) == plan.base_model_attr) + 1
        cbody[at:at] = head
        module = t.replace_class(module, plan.architecture, t.set_method(causal, t.with_body(cinit, cbody)))
        rows.append(FusionRow(plan.architecture, f"{plan.lm_head}: built by the causal LM"))
    return PassResult(module=module, fused=tuple(rows), matches=len(rows))


def _holder_args(call: cst.BaseExpression, cls: str) -> list[cst.Arg]:
    """The arguments ``call`` builds the holder class ``cls`` with: ``Cls(...)``, or
    ``wrapper(Cls, ...)``."""
    if not isinstance(call, cst.Call):
        raise HfrewriteError(f"{cls}: {NAME}: not built by a call")
    if t.dotted(call.func) == cls:
        return list(call.args)
    if call.args and not call.args[0].keyword and t.dotted(call.args[0].value) == cls:
        return list(call.args[1:])
    raise HfrewriteError(f"{cls}: {NAME}: built neither as {cls}(...) nor as wrapper({cls}, ...)")


def _holder_body(holder: cst.ClassDef, args: list[cst.Arg]) -> list[cst.BaseStatement]:
    """The holder's ``__init__`` statements, its parameters bound to ``args``."""
    init = t.find_method(holder, "__init__")
    params = list(init.params.params[1:])
    bound: dict[str, cst.BaseExpression] = {}
    positional = [a for a in args if not a.keyword and not a.star]
    for p, a in zip(params, positional):
        bound[p.name.value] = a.value
    for a in args:
        if a.keyword:
            bound[a.keyword.value] = a.value
    for p in params:
        if p.name.value not in bound:
            if p.default is None:
                raise HfrewriteError(f"{holder.name.value}: {NAME}: no argument for {p.name.value}")
            bound[p.name.value] = p.default
    for name, value in bound.items():
        if not isinstance(value, cst.Name | cst.BaseNumber | cst.SimpleString):
            raise HfrewriteError(f"{holder.name.value}: {NAME}: {name} is bound to an expression")
    statements = [s for s in init.body.body if not _super_init(s)]
    statements = [t.replace_names(s, dict(bound)) for s in statements]
    exprs = {attr: t.assigned_value(s) for s in statements if (attr := t.self_attr_assigned(s))}
    return [_tests_on_config(s, exprs) for s in statements]


def _tests_on_config(s: cst.BaseStatement, exprs: dict[str, cst.BaseExpression]) -> cst.BaseStatement:
    """An ``if`` testing the holder's own attributes, tested on what ``__init__`` assigns them
    (``if self.post_layer_norm:`` -> ``if config.post_layer_norm:``; analyze/flat_layout.py)."""
    if not isinstance(s, cst.If):
        return s
    names = {a: v for a, v in exprs.items() if t.root_names(v) <= {"config"}}

    class _Swap(cst.CSTTransformer):
        def leave_Attribute(self, original, updated):
            if t.dotted(updated.value) == "self" and updated.attr.value in names:
                return names[updated.attr.value]
            return updated

    return s.with_changes(test=s.test.visit(_Swap()))


def _merged(
    body: list[cst.BaseStatement], hoisted: list[cst.BaseStatement], cls: str
) -> list[cst.BaseStatement]:
    """``hoisted`` less the attributes the base model assigns the same way; refuses one it
    assigns otherwise, or a local both bind."""
    own = {t.self_attr_assigned(s): t.code(t.assigned_value(s)) for s in body if t.self_attr_assigned(s)}
    kept = []
    for s in hoisted:
        attr = t.self_attr_assigned(s)
        if attr in own:
            if own[attr] != t.code(t.assigned_value(s)):
                raise HfrewriteError(f"{cls}: {NAME}: self.{attr} is assigned otherwise by the base model")
            continue
        kept.append(s)
    clash = _locals(body) & _locals(kept)
    if clash:
        raise HfrewriteError(f"{cls}: {NAME}: locals {sorted(clash)} bound by the base model and a holder")
    return kept


def _locals(body: list[cst.BaseStatement]) -> set[str]:
    return {
        target.target.value
        for s in body
        for n in t.walk(s)
        if isinstance(n, cst.Assign)
        for target in n.targets
        if isinstance(target.target, cst.Name)
    }


def _unwrapped(s: cst.BaseStatement, cls: str) -> cst.BaseStatement:
    """``self.x = wrapper(nn.Linear, a, b, **kw)`` -> ``self.x = nn.Linear(a, b)``, where the
    analysis found ``x`` of class ``cls`` and the wrapper is given that class first."""
    call = t.assigned_value(s)
    if isinstance(call, cst.Call) and call.args and not call.args[0].keyword:
        first = t.dotted(call.args[0].value) or ""
        if first.rsplit(".", 1)[-1] == cls and t.dotted(call.func).rsplit(".", 1)[-1] != cls:
            args = [a for a in call.args[1:] if a.star != "**"]
            args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            new = call.with_changes(func=call.args[0].value, args=args)
            return s.with_changes(body=[s.body[0].with_changes(value=new)])
    return s


def _live(body: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
    """``body`` without the statements that only build locals nothing else reads
    (``init_method = ...``, ``init_kwargs = {}``, ``if device is not None: init_kwargs[...] = ...``)."""
    while True:
        dead = {n for n in _locals(body) if not any(n in _reads(s, n) for s in body)}
        kept = [s for s in body if not _writes_only(s, dead)]
        if len(kept) == len(body):
            return body
        body = kept


def _reads(s: cst.BaseStatement, name: str) -> set[str]:
    """``{name}`` where ``s`` reads it other than by writing into it."""
    if _writes_only(s, {name}):
        return set()
    return {name} if name in t.names_used(s) else set()


def _writes_only(s: cst.BaseStatement, names: set[str]) -> bool:
    """``s`` binds or writes into ``names`` and does nothing else."""
    if isinstance(s, cst.If) and s.orelse is None:
        return bool(s.body.body) and all(_writes_only(b, names) for b in s.body.body)
    if not (
        isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 and isinstance(s.body[0], cst.Assign)
    ):
        return False
    targets = [target.target for target in s.body[0].targets]
    roots = [
        x.value.value
        if isinstance(x, cst.Subscript) and isinstance(x.value, cst.Name)
        else getattr(x, "value", None)
        for x in targets
    ]
    return all(isinstance(r, str) and r in names for r in roots)


def _super_init(s: cst.BaseStatement) -> bool:
    return m.matches(s, SUPER_INIT_CALL)
