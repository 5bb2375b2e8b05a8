"""The source's routing, read for ``passes/fuse_experts.py``: whether and under which
config condition its router renormalises the top-k weights (checked against the trace), the
guards refusing configs that flip the router's other branches, and FusedMoEFactory's routing
options beyond softmax top-k, each from the source expression holding its constant."""

from __future__ import annotations

import ast

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.errors import HfrewriteError

NAME = "fuse_experts"


def _is_sum(node: cst.BaseExpression) -> bool:
    """``x.sum(...)``, possibly inside parentheses or further calls' receivers."""
    return bool(m.findall(node, m.Call(func=m.Attribute(attr=m.Name("sum")))))


def _renormalize(router: cst.ClassDef, attrs: dict[str, str] | None, name: str) -> str | None:
    """The source's condition for `w /= w.sum(...)` ("True" if unconditional), or None.
    The divisor may be a name assigned from a sum (`denominator = w.sum(...) + eps`);
    ``attrs`` None: the condition in the source's own terms (``self.<attr>``)."""
    forward = t.find_method(router, "forward")
    sums = {
        t.code(target.target)
        for a in m.findall(forward, m.Assign())
        for target in a.targets
        if isinstance(target.target, cst.Name) and _is_sum(a.value)
    }

    def _is_sum_or_name(node: cst.BaseExpression) -> bool:
        return _is_sum(node) or (isinstance(node, cst.Name) and node.value in sums)

    found = [condition for condition, _ in t.guarded_divisions(forward, _is_sum_or_name)]
    if len(found) > 1:
        raise HfrewriteError(f"{name}: {NAME}: the router renormalises more than once")
    if not found:
        return None
    condition = found[0]
    if attrs is None:
        return condition
    for attr, expr in attrs.items():  # `self.norm_topk_prob` -> `config.norm_topk_prob`
        condition = condition.replace(f"self.{attr}", expr)
    if "self." in condition:
        raise HfrewriteError(f"{name}: {NAME}: renormalisation depends on {condition}")
    return condition


def _traced_value(condition: str, branches) -> bool | None:
    """The value of a conjunction of the router's tests (each maybe negated) on the traced
    module, from ``branches`` ((test, value) of the router forward's switches); None where
    no conjunct decides it."""
    known = {ast.dump(ast.parse(test, mode="eval").body): value for test, value in branches}
    tree = ast.parse(condition, mode="eval").body
    conjuncts = tree.values if isinstance(tree, ast.BoolOp) and isinstance(tree.op, ast.And) else [tree]
    values = []
    for conjunct in conjuncts:
        negated = isinstance(conjunct, ast.UnaryOp) and isinstance(conjunct.op, ast.Not)
        value = known.get(ast.dump(conjunct.operand if negated else conjunct))
        values.append(None if value is None else value != negated)
    if False in values:
        return False
    return True if values and None not in values else None


def source_renormalize(
    router_cls: cst.ClassDef, router: dict[str, str], moe, name: str
) -> tuple[str | None, str]:
    """The source's renormalisation condition, checked against the trace, and the guards
    that refuse configs flipping the router's other branches."""
    renormalize = _renormalize(router_cls, router, name)
    router_forward = t.find_method(router_cls, "forward")
    divided = _renormalize(router_cls, None, name)  # the condition in the source's own terms
    if divided not in (None, "True") and _traced_value(divided, moe.router_branches) is False:
        # the division sits on a branch the traced config did not take (Cohere2-MoE's sigmoid
        # selection): the renormalisation the replay proved, if any, is the taken branch's own
        # softmax over the top-k logits; the guards below refuse the other branches
        renormalize = "True" if moe.renormalize else None
    if renormalize is None and moe.renormalize and not m.findall(router_forward, m.If() | m.IfExp()):
        renormalize = "True"  # a softmax over the top-k logits, unconditional: the replay proved it
    if (renormalize is None and moe.renormalize) or (renormalize == "True" and not moe.renormalize):
        raise HfrewriteError(f"{name}: {NAME}: the source's renormalisation disagrees with the trace")
    try:
        guards = t.branch_guards(moe.router_branches, router, name, "router", skip=renormalize)
        guards += _switch_guard(moe, router, name)
    except ValueError as e:
        raise HfrewriteError(f"{name}: {NAME}: the router branches on {e}, which no config field sets") from e
    return renormalize, guards


def _switch_guard(moe, router: dict[str, str], name: str) -> str:
    """Refuse the strings of the router's switch no trace proved."""
    if moe.router_switch is None:
        return ""
    attr, values = moe.router_switch
    expr = t.config_test(attr, router)
    proven = "(" + ", ".join(f'"{v}"' for v in values) + ")"
    return (
        f"if {expr} not in {proven}:\n"
        f'    raise NotImplementedError("hfrewrite: {name} was converted for {expr} in {proven.replace(chr(34), chr(39))}: '
        'its router takes another branch here")\n'
    )


def routing_kwargs(moe, where: dict[str, dict[str, str]], name: str) -> dict[str, str]:
    """FusedMoEFactory's routing options beyond softmax top-k. Each constant is the source's
    expression for the attribute analysis found holding its value (`self.num_group =
    config.n_group` -> `config.n_group`); ``where`` holds the router's and the block's
    ``__init__`` assignments."""
    if not moe.grouped:
        return {}
    exprs = {}
    for fact, path in moe.config_attrs:
        owner, attr = ("router", path.split(".", 1)[1]) if "." in path else ("block", path)
        expr = where[owner].get(attr)
        if expr is None or "self." in expr:
            raise HfrewriteError(
                f"{name}: {NAME}: the {fact} ({path}) is not set from the config in __init__"
            )
        exprs[fact] = expr
    kwargs = {
        "use_grouped_topk": "True",
        "num_expert_group": exprs.get("n_group", "1"),
        "topk_group": exprs.get("topk_group", "1"),
    }
    if moe.grouped_when:  # grouped on one branch of the router's switch, one group on the others
        try:
            when = t.config_test(moe.grouped_when, where["router"])
        except ValueError as e:
            raise HfrewriteError(
                f"{name}: {NAME}: the router switches on {e}, which no config field sets"
            ) from e
        for kwarg in ("num_expert_group", "topk_group"):
            kwargs[kwarg] = f"({kwargs[kwarg]} if {when} else 1)"
    if moe.scoring.vllm_name is not None:
        kwargs["scoring_func"] = f'"{moe.scoring.vllm_name}"'
    if "routed_scaling_factor" in exprs:  # the attribute the analysis found (whatever its value)
        kwargs["routed_scaling_factor"] = exprs["routed_scaling_factor"]
        kwargs["apply_routed_scale_to_output"] = "True"
    if moe.correction_bias:
        flat = "[0]" if moe.correction_bias_2d else ""  # a view: it sees the loaded values
        kwargs["e_score_correction_bias"] = f"self.{moe.correction_bias}{flat}"
    if moe.router_fp32:
        kwargs["router_logits_dtype"] = "torch.float32"
    return kwargs
