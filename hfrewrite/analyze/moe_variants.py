"""The other branches of a router's string switch, proven so that one file serves every
released config of its type.

DeepSeek-V2-Lite routes with ``topk_method: "greedy"``, DeepSeek-V2, V2.5 and Coder-V2 with
``"group_limited_greedy"``: one ``if``/``elif`` chain of the router's forward on one config
field. The analysis traced one branch; each other string the chain compares the field with is
traced on a sibling config that sets it, and the MoE analysis runs on it as on the first.
A branch is carried when its plan agrees with the traced one on everything but the routing
sizes (group count, groups kept) and the branches: then the file computes the routing each
config selects, and refuses only strings the chain does not prove. Fields the other branch
reads that the traced config leaves unset (``n_group: null``) are given a size; the shrunk
copy sets its own.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
from collections.abc import Callable

from torch import nn

from hfrewrite.analyze.branches import init_assignments, method_tree
from hfrewrite.analyze.plan import MoePlan, NoMatch, Refusal

PATTERN = "fused_moe"
# MoePlan fields two proven routing branches may differ in (sizes come from the config)
_MAY_DIFFER = {"num_experts", "n_group", "topk_group", "config_attrs", "router_branches"}


def with_other_routings(
    config, plan: MoePlan, router: nn.Module, analyze: Callable[[object], object]
) -> tuple[MoePlan, tuple[NoMatch, ...], tuple[tuple[str, object], ...]]:
    """``plan`` extended by the router branches proven on sibling configs (``analyze(config)``
    returns a sibling's MoE plan), what could not be proven, and the sibling configs proven."""
    switch = _string_switch(router, plan)
    if switch is None:
        return plan, (), ()
    attr, field, taken, others, reads = switch
    declined: list[NoMatch] = []
    proven: list[tuple[str, object]] = []
    grouped_when = None
    for value in others:
        sibling = copy.deepcopy(config)
        setattr(sibling, field, value)
        for unset in reads.get(value, ()):
            if getattr(sibling, unset, 0) is None:
                setattr(sibling, unset, 1)  # any size: the shrunk copy sets its own
        what = f"{field} {value!r}"
        try:
            other = analyze(sibling)
        except Refusal as refusal:
            other = refusal.no_match
        if not isinstance(other, MoePlan):
            reason = other.reason if isinstance(other, NoMatch) else "no MoE block"
            declined.append(NoMatch(PATTERN, plan.module_class, f"router with {what}: not proven ({reason})"))
            continue
        differ = [
            f.name
            for f in dataclasses.fields(MoePlan)
            if f.name not in _MAY_DIFFER and getattr(other, f.name) != getattr(plan, f.name)
        ]
        grouping = (other.n_group is not None) != (plan.n_group is not None)
        if differ or (grouping and grouped_when is not None):
            why = f"the plan differs in {', '.join(differ)}" if differ else "a second grouped branch"
            declined.append(NoMatch(PATTERN, plan.module_class, f"router with {what}: {why}"))
            continue
        if grouping:
            grouped = other if other.n_group is not None else plan
            test = f"self.{attr} == {(value if other.n_group is not None else taken)!r}"
            grouped_when = test
            plan = dataclasses.replace(plan, config_attrs=_union(plan.config_attrs, grouped.config_attrs))
        proven.append((what, sibling))
    if not proven:
        return plan, tuple(declined), ()
    values = (taken, *(v for v in others if any(what == f"{field} {v!r}" for what, _ in proven)))
    return (
        dataclasses.replace(
            plan,
            grouped_when=grouped_when,
            router_switch=(f"self.{attr}", values),
            router_branches=tuple(b for b in plan.router_branches if f"self.{attr}" not in b[0]),
        ),
        tuple(declined),
        tuple(proven),
    )


def _union(a: tuple, b: tuple) -> tuple:
    return tuple(dict.fromkeys((*a, *b)))


def _string_switch(router: nn.Module, plan: MoePlan):
    """(attribute, config field, traced string, other strings, {string: config fields its
    branch reads}) of the router forward's one ``self.<attr> == "<string>"`` chain on a
    config field; None when there is none (or more than one)."""
    forward = method_tree(type(router), "forward")
    if forward is None:
        return None
    fields = _config_fields(type(router))
    chains: dict[str, dict[str, ast.If]] = {}
    for node in ast.walk(forward):
        if isinstance(node, ast.If) and (hit := _compares_string(node.test)) and hit[0] in fields:
            chains.setdefault(hit[0], {})[hit[1]] = node
    taken = {
        hit
        for test, outcome in plan.router_branches
        if outcome and (hit := _compares_string(ast.parse(test, mode="eval").body))
    }
    switches = [(attr, value) for attr, value in taken if attr in chains]
    if len(switches) != 1:
        return None
    attr, value = switches[0]
    others = tuple(v for v in chains[attr] if v != value)
    if not others:
        return None
    reads = {
        v: tuple(fields[a] for a in _self_reads(chains[attr][v].body) if a in fields and a != attr)
        for v in others
    }
    return attr, fields[attr], value, others, reads


def _compares_string(test: ast.AST) -> tuple[str, str] | None:
    """("attr", "string") for a test ``self.<attr> == "<string>"``."""
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Eq)
        and isinstance(test.left, ast.Attribute)
        and isinstance(test.left.value, ast.Name)
        and test.left.value.id == "self"
        and isinstance(test.comparators[0], ast.Constant)
        and isinstance(test.comparators[0].value, str)
    ):
        return test.left.attr, test.comparators[0].value
    return None


def _config_fields(cls: type) -> dict[str, str]:
    """``self.<attr> = config.<field>`` assignments of ``__init__``: {attr: field}."""
    return {
        attr: value.attr
        for attr, value in init_assignments(cls).items()
        if isinstance(value, ast.Attribute)
        and isinstance(value.value, ast.Name)
        and value.value.id == "config"
    }


def _self_reads(body: list[ast.stmt]) -> list[str]:
    return [
        n.attr
        for stmt in body
        for n in ast.walk(stmt)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    ]
