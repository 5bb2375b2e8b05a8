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

from hfrewrite.analyze.plan import AttentionPlan, LinearFact, MlaPlan
from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.attention_body import convention_locals, traced_branch
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites

NAME = "taken_branches"


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    switches: dict[str, dict[str, bool]] = {}
    for cls, test, value in ctx.plan.forward_switches:
        switches.setdefault(cls, {})[ast.dump(ast.parse(test, mode="eval").body)] = value
    if _traced_attention(ctx.plan):  # its calling-convention branches
        switches.setdefault(_traced_attention(ctx.plan), {})
    sites, rows = Sites(), []
    for name, known in sorted(switches.items()):
        cls = next((n for n in module.body if isinstance(n, cst.ClassDef) and n.name.value == name), None)
        forward = cls and t.find_method(cls, "forward")
        if forward is None:
            continue
        exprs = t.init_exprs(cls) if t.find_method(cls, "__init__") else {}
        chooser = _TakenBranch(known, exprs, _projections(ctx.plan))
        if name == _traced_attention(ctx.plan):  # the traced call's branch (not MLA's: both proven)
            chooser.convention = convention_locals(forward)
            chooser.ran = set(getattr(ctx.plan.attention, "traced_lines", ()))
        cls = t.set_method(cls, forward.visit(chooser))
        chooser.convention = set()
        init = t.find_method(cls, "__init__")
        mla = isinstance(ctx.plan.attention, MlaPlan) and name == ctx.plan.attention.module_class
        if init is not None and not mla:  # projections built in a branch (`if self.is_cross_attention:`)
            chooser.bare = {p.name.value for p in (*init.params.params, *init.params.kwonly_params)}
            cls = t.set_method(cls, init.visit(chooser))
        if chooser.taken:
            module = sites.replace_class(module, name, cls)
            rows += [
                FusionRow(name, f"config switch `{test}`: the traced branch kept")
                for test in dict.fromkeys(chooser.taken)
            ]
    return PassResult(module=module, fused=tuple(rows), matches=sites.count)


def _traced_attention(plan) -> str | None:
    """The attention class whose forward's branches the trace decides (an AttentionPlan's;
    MLA keeps both branches of its query, each proven on a config of its own)."""
    return plan.attention.module_class if isinstance(plan.attention, AttentionPlan) else None


def _projections(plan) -> set[str]:
    """The attributes of the projections the fusing passes must find called once."""
    found = {f.attr for r in "qkvo" if isinstance(f := getattr(plan.attention, r, None), LinearFact)}
    if plan.mlp is not None:
        found |= {f.attr for f in (plan.mlp.gate, plan.mlp.up, plan.mlp.down) if f is not None}
    return found


def _conjuncts(test: cst.BaseExpression) -> list[cst.BaseExpression]:
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return [*_conjuncts(test.left), *_conjuncts(test.right)]
    return [test]


class _TakenBranch(cst.CSTTransformer):
    def __init__(self, known: dict[str, bool], init_exprs: dict[str, str], projections: set[str]) -> None:
        self.known, self.init_exprs, self.taken = known, init_exprs, []
        self.projections = projections
        self.convention: set[str] = set()  # the forward's calling-convention names
        self.ran: set[str] = set()  # the forward's lines the trace ran
        self.bare: set[str] = set()  # names a switch may read besides self: __init__'s parameters

    def leave_If(self, original: cst.If, updated: cst.If):
        if isinstance(updated.orelse, cst.If):
            return updated  # elif chains: left as written
        if self.convention and self._false_conjunct(updated.test):  # GPT-2's reorder_and_upcast_attn
            self.taken.append(t.code(updated.test))
            return (
                cst.FlattenSentinel([*updated.orelse.body.body]) if updated.orelse else cst.RemoveFromParent()
            )
        both = self.convention and updated.orelse is not None  # the attention's if/else (GPT-J's rope)
        if not (t.self_attrs_used(updated) & self.projections or both):
            return updated  # a switch the other passes read (renormalize=config.norm_topk_prob)
        if self.convention and (value := traced_branch(original, self.convention, self.ran)) is not None:
            self.taken.append(t.code(updated.test))  # the traced call took it: it ran those lines
        elif t.root_names(updated.test) - {"self", "None", "True", "False"} - self.bare:
            return updated  # a forward's local or argument is not a config switch
        elif (value := self._known(updated.test)) is None:
            return updated
        else:
            self.taken.append(t.config_test(t.code(updated.test), self.init_exprs))
        body = updated.body.body if value else (updated.orelse.body.body if updated.orelse else ())
        if not body:
            return cst.RemoveFromParent()
        return cst.FlattenSentinel([*body])

    def _false_conjunct(self, test: cst.BaseExpression) -> bool:
        """``a and <switch traced False>``: false whatever ``a`` is."""
        parts = _conjuncts(test)
        return len(parts) > 1 and any(
            not t.root_names(p) - {"self", "None", "True", "False"} and self._known(p) is False for p in parts
        )

    def _known(self, test: cst.BaseExpression) -> bool | None:
        """The traced value of a config switch test, None when it is not one."""
        try:
            test = t.config_test(t.code(test), self.init_exprs)
        except ValueError:
            return None
        return self.known.get(ast.dump(ast.parse(test, mode="eval").body))
