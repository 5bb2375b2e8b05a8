"""A config switch in a forward, replaced by the branch the traced config took.

Matches, in the forward of each class the analysis found config switches in,
``if <switch>: A`` / ``if <switch>: A else: B`` around the projections the fusing
passes must find called once, whose test is, in the form ``__init__`` evaluates, one of
``ModelPlan.forward_switches`` (Llama-era ``if self.config.pretraining_tp > 1:``).

Emits the taken branch's statements in place of the ``if``. ``config_guards`` (later) then
refuses, in ``__init__``, the configs that would take the other branch: the class no longer
tests the switch.

Preconditions (otherwise the statement stays): no ``elif``; the test reads only the module's
own attributes and constants.
"""

from __future__ import annotations

import ast

import libcst as cst

from hfrewrite.analyze.plan import LinearFact
from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites

NAME = "taken_branches"


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    switches: dict[str, dict[str, bool]] = {}
    for cls, test, value in ctx.plan.forward_switches:
        switches.setdefault(cls, {})[ast.dump(ast.parse(test, mode="eval").body)] = value
    sites, rows = Sites(), []
    for name, known in sorted(switches.items()):
        cls = next((n for n in module.body if isinstance(n, cst.ClassDef) and n.name.value == name), None)
        forward = cls and t.find_method(cls, "forward")
        if forward is None:
            continue
        chooser = _TakenBranch(known, t.init_exprs(cls), _projections(ctx.plan))
        cls = t.set_method(cls, forward.visit(chooser))
        init = t.find_method(cls, "__init__")
        if init is not None:  # the projections built in a branch (`if self.is_cross_attention:`)
            cls = t.set_method(cls, init.visit(chooser))
        if chooser.taken:
            module = sites.replace_class(module, name, cls)
            rows += [
                FusionRow(name, f"config switch `{test}`: the traced branch kept")
                for test in dict.fromkeys(chooser.taken)
            ]
    return PassResult(module=module, fused=tuple(rows), matches=sites.count)


def _projections(plan) -> set[str]:
    """The attributes of the projections the fusing passes must find called once."""
    found = {f.attr for r in "qkvo" if isinstance(f := getattr(plan.attention, r, None), LinearFact)}
    if plan.mlp is not None:
        found |= {f.attr for f in (plan.mlp.gate, plan.mlp.up, plan.mlp.down) if f is not None}
    return found


class _TakenBranch(cst.CSTTransformer):
    def __init__(self, known: dict[str, bool], init_exprs: dict[str, str], projections: set[str]) -> None:
        self.known, self.init_exprs, self.taken = known, init_exprs, []
        self.projections = projections

    def leave_If(self, original: cst.If, updated: cst.If):
        if isinstance(updated.orelse, cst.If):
            return updated  # elif chains: left as written
        if not t.self_attrs_used(updated) & self.projections:
            return updated  # a switch the other passes read (renormalize=config.norm_topk_prob)
        try:
            test = t.config_test(t.code(updated.test), self.init_exprs)
        except ValueError:
            return updated
        value = self.known.get(ast.dump(ast.parse(test, mode="eval").body))
        if value is None:
            return updated
        self.taken.append(test)
        body = updated.body.body if value else (updated.orelse.body.body if updated.orelse else ())
        if not body:
            return cst.RemoveFromParent()
        return cst.FlattenSentinel([*body])
