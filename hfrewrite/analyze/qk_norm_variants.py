"""The q/k norms a config switch leaves off, proven so that one file serves both settings.

StableLM's ``qk_layernorm`` (off in StableLM-2-1.6B, on in StableLM-2-12B) and Cohere's
``use_qk_norm`` (off in Command R, on in Command R+) turn per-head q/k norms on in the
attention's forward. Where the traced config leaves such a switch off, the same type is
traced again on a sibling config that turns it on. The sibling's norms are carried, under
the source's own test, only when its attention plan agrees with the first on everything
but the norms; else the file keeps refusing configs that turn the switch on.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
from collections.abc import Callable

from torch import nn

from hfrewrite.analyze.branches import asks_own_attribute, config_branches, init_assignments, method_tree
from hfrewrite.analyze.plan import AttentionPlan, NoMatch, Refusal
from hfrewrite.analyze.shrink import INVALID_FIELD

PATTERN = "vllm_attention"
# what the sibling's plan may add; every other field must agree
_NORM_FIELDS = ("q_norm", "k_norm", "qk_norm_over", "qk_norm_order", "qk_norm_layers_some", "replaced_calls")


def with_qk_norm_branch(
    config, plan: AttentionPlan, attention: nn.Module, analyze: Callable[[object], object]
) -> tuple[AttentionPlan, tuple[NoMatch, ...], tuple[tuple[str, object], ...]]:
    """``plan`` with the q/k norms of the branch the traced config left off, where a sibling
    config proves them (``analyze(config)`` returns its attention plan); what could not be
    proven; and the sibling config proven (validated at convert time too)."""
    if plan.q_norm is not None:
        return plan, (), ()
    flipped = _switched_on(config, attention)
    if flipped is None:
        return plan, (), ()
    field, sibling = flipped
    what = f"q/k norms ({field} true)"
    try:
        other = analyze(sibling)
    except Refusal as refusal:
        other = refusal.no_match
    if not isinstance(other, AttentionPlan) or other.q_norm is None:
        reason = other.reason if isinstance(other, NoMatch) else "the sibling's attention has no q/k norms"
        return plan, (NoMatch(PATTERN, plan.module_class, f"{what}: not proven ({reason})"),), ()
    fixed = {f.name for f in dataclasses.fields(AttentionPlan) if f.compare} - set(_NORM_FIELDS)
    differ = sorted(f for f in fixed if getattr(other, f) != getattr(plan, f))
    if differ:
        reason = f"{what}: the plan differs in {', '.join(differ)}"
        return plan, (NoMatch(PATTERN, plan.module_class, reason),), ()
    calls = tuple(dict.fromkeys((*plan.replaced_calls, *other.replaced_calls)))
    norms = {f: getattr(other, f) for f in _NORM_FIELDS if f != "replaced_calls"}
    return dataclasses.replace(plan, **norms, replaced_calls=calls), (), ((what, sibling),)


def _switched_on(config, attention: nn.Module) -> tuple[str, object] | None:
    """(field, sibling config) for the one ``if self.<attr>:`` of the forward that the traced
    config left off and whose body calls modules the traced module does not build, where
    ``__init__`` assigns ``self.<attr> = config.<field>``."""
    fields = _config_attrs(type(attention))
    taken = dict(config_branches(attention))
    tree = method_tree(type(attention), "forward")
    off = []
    for node in ast.walk(tree) if tree is not None else ():
        if not isinstance(node, ast.If):
            continue
        field = fields.get(_self_attr(node.test)) or _built_under(node.test, type(attention))
        if field and taken.get(ast.unparse(node.test)) is not True and _unbuilt_attrs(node, attention):
            off.append(field)
    off = [f for f in dict.fromkeys(off) if getattr(config, f, None) is False]
    if len(off) != 1:
        return None
    sibling = copy.deepcopy(config)
    try:
        setattr(sibling, off[0], True)
    except INVALID_FIELD:
        return None
    return off[0], sibling


def _built_under(test: ast.expr, cls: type) -> str | None:
    """For ``hasattr(self, "<attr>")`` (Llama-4's ``if hasattr(self, "qk_norm"):``): the one
    config field read by the tests of ``cls.__init__`` under which it builds ``self.<attr>``
    (``if self.config.use_qk_norm and self.use_rope:``), else None."""
    if not (
        asks_own_attribute(test)
        and test.func.id == "hasattr"
        and len(test.args) == 2
        and isinstance(test.args[1], ast.Constant)
        and isinstance(test.args[1].value, str)
    ):
        return None
    attr, init = test.args[1].value, method_tree(cls, "__init__")
    fields = {
        read.attr
        for node in (ast.walk(init) if init is not None else ())
        if isinstance(node, ast.If) and any(_assigns(s, attr) for s in node.body)
        for read in ast.walk(node.test)
        if isinstance(read, ast.Attribute) and ast.unparse(read.value) in ("config", "self.config")
    }
    return fields.pop() if len(fields) == 1 else None


def _assigns(statement: ast.stmt, attr: str) -> bool:
    return isinstance(statement, ast.Assign) and any(_self_attr(t) == attr for t in statement.targets)


def _self_attr(node: ast.expr) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _unbuilt_attrs(branch: ast.If, attention: nn.Module) -> bool:
    """The branch calls ``self.<attr>(...)`` for an attribute the traced module lacks."""
    called = {_self_attr(n.func) for s in branch.body for n in ast.walk(s) if isinstance(n, ast.Call)}
    return any(attr is not None and not hasattr(attention, attr) for attr in called)


def _config_attrs(cls: type) -> dict[str, str]:
    """attr -> field for each ``self.<attr> = config.<field>`` of ``cls.__init__``."""
    return {
        attr: value.attr
        for attr, value in init_assignments(cls).items()
        if isinstance(value, ast.Attribute)
        and isinstance(value.value, ast.Name)
        and value.value.id == "config"
    }
