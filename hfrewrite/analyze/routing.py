"""Router facts of a MoE block, read from the fx graph and proven by replay (analyze/moe.py).

What the routing computes, from the graph slice that feeds the experts' index and weights::

    logits = F.linear(x[.float()], router.weight[.float()][, router.bias])
    scores = softmax(logits) | sigmoid(logits)
    choice = scores [+ correction_bias]                    # e_score_correction_bias
    [groups: top-``topk_group`` of ``n_group`` groups by their top-2 (or max) score]
    idx = topk(choice, top_k)[1];  w = scores[idx]
    [w = w / w.sum()]  [w = w * routed_scaling_factor]

The structure proposes each fact (which op, which tensor, which constant); the numeric
replay in analyze/moe.py, with the correction bias randomised, decides. :func:`route` is
the reference: the arithmetic of vLLM 0.32's CPU router (grouped top-k path), so a plan
that replays right is one vLLM computes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

from hfrewrite.analyze.plan import MoePlan
from hfrewrite.analyze.router_scorings import Scoring, scoring_computed_by
from hfrewrite.analyze.trace import Traced, relative, value

PASS_THROUGH = ("to", "float", "type", "type_as", "contiguous")
_DIVS = (operator.truediv, operator.itruediv, torch.div, "div", "div_")
MULS = (operator.mul, operator.imul, torch.mul, "mul", "mul_")


def skip(node):
    """Step back over dtype casts and copies."""
    while isinstance(node, Node) and node.op == "call_method" and node.target in PASS_THROUGH:
        node = node.args[0]
    return node


def scoring_of(node) -> Scoring | None:
    """The router scoring a traced node computes, if it computes one."""
    if isinstance(node, Node) and node.op in ("call_function", "call_method"):
        return scoring_computed_by(node.target)
    return None


def _backward(roots: list[Node], ordered: list[Node]) -> list[Node]:
    """Nodes inside the block that ``roots`` are computed from, in-place updates of them
    included (``mask.scatter_(...)``)."""
    inside, seen = set(ordered), set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n in seen or n not in inside:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
        todo.extend(u for u in n.users if _in_place(u))
    return [n for n in ordered if n in seen]


def _in_place(node: Node) -> bool:
    return (node.op == "call_method" and node.target.endswith("_") and not node.target.endswith("__")) or (
        node.target
        in (
            operator.setitem,
            operator.iadd,
            operator.imul,
            operator.itruediv,
            operator.isub,
        )
    )


def _is_fp32_cast(node) -> bool:
    if not (isinstance(node, Node) and node.op == "call_method"):
        return False
    return node.target == "float" or (node.target in ("to", "type") and torch.float32 in node.args[1:])


def _topk_k(node: Node) -> int:
    return int(value(node.args[1]) if len(node.args) > 1 else node.kwargs["k"])


@dataclass(frozen=True)
class _Projection:
    """The router's one linear projection and what it tells of the router."""

    logits: Node
    router: str  # the block's child that routes
    router_linear: str | None  # its child holding the Linear, if the Linear is not the router itself
    weight: Node | None  # the weight F.linear reads; None for an nn.Linear call
    bias: object  # the bias F.linear reads, or the nn.Linear's bias parameter
    num_experts: int
    fp32: bool  # the projection runs in float32


def _projection(traced: Traced, path: str, nodes: list[Node]) -> _Projection | str:
    """The one linear projection computing the router logits, or why not."""
    linears = [
        n
        for n in nodes
        if (n.op == "call_function" and n.target is F.linear)
        or (n.op == "call_module" and isinstance(traced.submodule(n), nn.Linear))
    ]
    if len(linears) != 1 or any(n.op == "call_module" and n not in linears for n in nodes):
        return "router logits are not one linear projection of the block input"
    logits = linears[0]
    if logits.op == "call_module":  # a Linear inside the router (hunyuan's gate.wg)
        return _module_projection(traced, path, logits)
    return _functional_projection(path, logits)


def _module_projection(traced: Traced, path: str, logits: Node) -> _Projection | str:
    """The router logits as an ``nn.Linear`` call, or why not."""
    linear_path = relative(logits.target, path)
    if linear_path.count(".") > 1:
        return "the router is not a module holding its linear projection"
    # the block's own Linear (custom code), or a Linear inside a router module
    router, router_linear = linear_path.split(".") if "." in linear_path else (linear_path, None)
    linear = traced.submodule(logits)
    fp32 = _is_fp32_cast(logits.args[0]) and linear.weight.dtype == torch.float32
    return _Projection(logits, router, router_linear, None, linear.bias, linear.out_features, fp32)


def _functional_projection(path: str, logits: Node) -> _Projection | str:
    """The router logits as ``F.linear`` of a router submodule's own parameters, or why not."""
    weight = skip(logits.args[1])
    bias = logits.args[2] if len(logits.args) > 2 else logits.kwargs.get("bias")
    if not (isinstance(weight, Node) and weight.op == "get_attr"):
        return "router weight is not a module parameter"
    if bias is not None and not (isinstance(bias, Node) and bias.op == "get_attr"):
        return "the router's bias is not a module parameter"
    router = relative(weight.target, path).rsplit(".", 1)[0]
    if "." in router or router == relative(weight.target, path):
        return "the router weight is not held by a router submodule of the block"
    if bias is not None and relative(bias.target, path) != f"{router}.bias":
        return f"the router's bias is {relative(bias.target, path)}, not the router's own bias parameter"
    num_experts = value(weight).shape[0]
    fp32 = _is_fp32_cast(logits.args[0]) and _is_fp32_cast(logits.args[1])
    return _Projection(logits, router, None, weight, bias, num_experts, fp32)


def _correction(nodes: list[Node], path: str, proj: _Projection) -> tuple[str | None, bool] | str:
    """(the per-expert bias routing adds to the scores, whether it is ``[1, E]``),
    (None, False) without one, or why not."""
    known = {proj.weight, proj.bias}
    tensors = [n for n in nodes if n.op == "get_attr" and n not in known]
    correction, correction_2d = None, False
    for n in tensors:
        t = value(n)
        name = relative(n.target, path)
        # the router's own (deepseek's gate.e_score_correction_bias, ernie's in a child of
        # it), or the block's own, handed to the router (minimax_m2's)
        if not (
            torch.is_tensor(t)
            and t.shape in ((proj.num_experts,), (1, proj.num_experts))
            and (name.startswith(f"{proj.router}.") or "." not in name)
        ):
            return f"routing reads {name}, which is not a per-expert bias of the router or the block"
        if correction not in (None, name):
            return "routing reads more than one per-expert bias"
        correction, correction_2d = name, t.dim() == 2
    return correction, correction_2d


@dataclass(frozen=True)
class _Choice:
    """How routing chooses the experts: a top-k, after a top-k of groups if grouped."""

    topk: Node  # the top-k whose indices are the experts' index
    n_group: int | None
    topk_group: int | None


def _choice(nodes: list[Node], index: Node, num_experts: int) -> _Choice | str:
    """The top-k choosing the experts and the grouping before it, or why not."""
    topks = [n for n in nodes if n.target is torch.topk or (n.op == "call_method" and n.target == "topk")]
    final = skip(index)
    if not (final.target is operator.getitem and final.args[1] == 1 and final.args[0] in topks):
        return "the experts' index is not the indices of a top-k"
    final = final.args[0]
    n_group = topk_group = None
    groups = [n for n in topks if n is not final]
    if groups:
        selects = [n for n in groups if value(n.args[0]).dim() == 2]
        if len(selects) != 1 or len(groups) > 2:
            return "grouped routing is not one top-k over group scores"
        n_group, topk_group = value(selects[0].args[0]).shape[-1], _topk_k(selects[0])
        if num_experts % n_group:
            return f"{n_group} expert groups do not divide {num_experts} experts"
    return _Choice(final, n_group, topk_group)


def _scales(nodes: list[Node]) -> list:
    """The numbers routing multiplies by."""
    return [
        a
        for n in nodes
        if n.target in MULS
        for a in n.args
        if isinstance(a, (int, float)) and not isinstance(a, bool)
    ]


def _renormalizes(nodes: list[Node], inside: list[Node]) -> bool:
    """Routing divides by a sum."""
    return any(
        n.target in _DIVS
        and isinstance(n.args[1], Node)
        and any(d.target == "sum" for d in _backward([n.args[1]], inside))
        for n in nodes
    )


def router_facts(traced: Traced, path: str, block: nn.Module, index, weights, hidden) -> dict | str:
    """The routing fields of ``MoePlan`` for the routing that computes ``index`` and
    ``weights``, or why not. ``renormalize`` is what the structure shows; the replay may
    prove the other value (a softmax over the top-k logits is a renormalised softmax)."""
    inside = traced.nodes_in(path)
    nodes = _backward([index, weights], inside)
    proj = _projection(traced, path, nodes)
    if isinstance(proj, str):
        return proj
    if root(proj.logits.args[0]) is not root(hidden):
        return "router and experts read different inputs"

    scorings = [n for n in nodes if scoring_of(n) is not None]
    if len(scorings) != 1:
        return f"router scoring is not one softmax or sigmoid ({len(scorings)} found)"
    scoring = scoring_of(scorings[0])

    correction = _correction(nodes, path, proj)
    if isinstance(correction, str):
        return correction
    choice = _choice(nodes, index, proj.num_experts)
    if isinstance(choice, str):
        return choice

    scales = _scales(nodes)
    if len(scales) > 1:
        return f"the routing weights are scaled more than once ({scales})"
    scale = float(scales[0]) if scales else 1.0
    renormalize = _renormalizes(nodes, inside)

    facts = {"n_group": choice.n_group, "topk_group": choice.topk_group}
    if scales:
        facts["routed_scaling_factor"] = scale
    attrs = config_attrs(block, proj.router, facts)
    if isinstance(attrs, str):
        return attrs
    return {
        "router": proj.router,
        "top_k": _topk_k(choice.topk),
        "scoring": scoring,
        "renormalize": renormalize,
        "router_linear": proj.router_linear,
        "router_bias": proj.bias is not None,
        "router_fp32": proj.fp32,
        "correction_bias": correction[0],
        "correction_bias_2d": correction[1],
        "n_group": choice.n_group,
        "topk_group": choice.topk_group,
        "routed_scaling_factor": scale,
        "config_attrs": attrs,
    }


def root(node):
    """Step back over reshapes to the tensor they view."""
    while (
        isinstance(node, Node)
        and node.op == "call_method"
        and node.target in ("view", "reshape", *PASS_THROUGH)
    ):
        node = node.args[0]
    return node


def config_attrs(block: nn.Module, router: str, facts: dict) -> tuple[tuple[str, str], ...] | str:
    """Where each routing constant lives: the one attribute of the router (or else of the
    block) holding its value, whose source expression the emitted file keeps."""
    owners = ((f"{router}.", block.get_submodule(router)), ("", block))
    found = []
    for fact, want in facts.items():
        if want is None:
            continue
        for prefix, owner in owners:
            names = sorted(
                k
                for k, v in vars(owner).items()
                if not k.startswith("_") and type(v) in (int, float) and v == want
            )
            if len(names) > 1:
                return f"the {fact} {want} is held by several attributes ({', '.join(names)})"
            if names:
                found.append((fact, prefix + names[0]))
                break
        else:
            return f"the {fact} {want} is not an attribute of the router or the block"
    return tuple(found)


def route(logits: torch.Tensor, facts: MoePlan, correction: torch.Tensor | None):
    """(weights, index) as vLLM's CPU router computes them for ``facts``."""
    logits = logits.float()
    if not facts.grouped:
        w, idx = torch.topk(torch.softmax(logits, dim=-1), facts.top_k, dim=-1)
        return (w / w.sum(dim=-1, keepdim=True) if facts.renormalize else w), idx
    scores = facts.scoring.reference(logits)
    groups = facts.n_group or 1
    choice = scores if correction is None else scores + correction.float()
    grouped = choice.view(len(choice), groups, -1)
    group_scores = (
        grouped.max(dim=-1).values if correction is None else grouped.topk(2, dim=-1)[0].sum(dim=-1)
    )
    chosen = torch.topk(group_scores, k=facts.topk_group or 1, dim=-1)[1]
    keep = torch.zeros_like(group_scores).scatter_(1, chosen, 1).bool()
    choice = choice.masked_fill(~keep.repeat_interleave(choice.shape[-1] // groups, dim=-1), float("-inf"))
    idx = torch.topk(choice, k=facts.top_k, dim=-1)[1]
    w = scores.gather(1, idx)
    if facts.renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w * facts.routed_scaling_factor, idx


def output_scale(traced: Traced, path: str, experts_call: Node) -> tuple[Node, float] | None:
    """(the product, the constant) when the block multiplies the experts' output by one
    number before anything else reads it (vLLM's routed scale applied to the output)."""
    inside = set(traced.nodes_in(path))
    users = [u for u in users_through_views(experts_call) if u in inside]
    if len(users) != 1 or users[0].target not in MULS:
        return None
    numbers = [a for a in users[0].args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    return (users[0], float(numbers[0])) if len(numbers) == 1 and len(users[0].args) == 2 else None


def users_through_views(node: Node) -> list[Node]:
    """The users of ``node``, past views, reshapes and casts."""
    users, todo = [], list(node.users)
    while todo:
        u = todo.pop(0)
        if u.op == "call_method" and u.target in ("view", "reshape", *PASS_THROUGH):
            todo.extend(u.users)
        else:
            users.append(u)
    return users
