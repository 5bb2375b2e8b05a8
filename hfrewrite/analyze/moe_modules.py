"""Experts held one module each (an ``nn.ModuleList`` of MLPs, as custom code and older
transformers releases write them), dispatched by a Python loop over the experts.

Pattern::

    weights, chosen = topk(scoring(router(x)), k)   # router: an nn.Linear of the block
    for e, expert in enumerate(self.experts):       # per-expert gather, call, scatter
        ...

The loop is not a structure vLLM keeps: what the analysis proves is what the block
computes. The routing facts come from the graph up to the top-k (``router_facts``), the
expert MLP from its own trace (``analyze_mlp`` on expert 0, every expert of its class),
and ``moe._replay`` must then reproduce the block from them (routing, per-expert
weights, weighted sum), which is the proof the rewrite rests on.
"""

from __future__ import annotations

import ast
import operator

import torch
from torch import nn
from torch.fx import Node

from hfrewrite.analyze.branches import init_assignments
from hfrewrite.analyze.mlp import analyze_mlp
from hfrewrite.analyze.mlp_forms import MlpForm
from hfrewrite.analyze.plan import MlpPlan, NoMatch
from hfrewrite.analyze.trace import Traced, trace, value

PATTERN = "fuse_experts"


def expert_list(block: nn.Module) -> str | None:
    """The attribute of the block's one ``nn.ModuleList`` of at least two experts of one
    class, each holding Linears, or None."""
    found = [
        name
        for name, child in block.named_children()
        if isinstance(child, nn.ModuleList)
        and len(child) >= 2
        and len({type(m) for m in child}) == 1
        and any(isinstance(m, nn.Linear) for m in child[0].modules())
    ]
    return found[0] if len(found) == 1 else None


def expert_mlp(block: nn.Module, attr: str, config) -> MlpPlan | NoMatch:
    """The facts of the experts' MLP, from a trace of expert 0 on example tokens."""
    expert = getattr(block, attr)[0]
    width = next(m for m in expert.modules() if isinstance(m, nn.Linear)).in_features
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(5, width, generator=generator)
    try:
        traced = trace(expert, (tokens,))
    except TypeError:  # Mixtral 4.36's experts: forward(hidden_states, routing_weights)
        traced = _weighted_expert(expert, tokens, generator)
        if isinstance(traced, str):
            return NoMatch(PATTERN, type(expert).__name__, traced)
    plan = analyze_mlp(traced, "", config)
    if isinstance(plan, NoMatch):
        return plan
    if plan.form is not MlpForm.AND_MUL or plan.fused_gate_up or plan.gate.bias or plan.down.bias:
        return NoMatch(PATTERN, type(expert).__name__, "the experts are not bias-free gate/up/down MLPs")
    return plan


def _weighted_expert(expert: nn.Module, tokens: torch.Tensor, generator) -> Traced | str:
    """The trace of an expert called as ``expert(tokens, routing_weights)`` (Mixtral 4.36),
    cut before its last step when that step only scales the MLP's output by the weights
    (``routing_weights * down(...)``), so that what remains is the MLP; or why not. The cut
    only locates the MLP's facts: the block's replay (``moe._replay``), which multiplies
    by the routing weights itself, is still the proof."""
    weights = torch.rand(tokens.shape[0], 1, generator=generator)
    try:
        traced = trace(expert, (tokens, weights))
    except TypeError as e:
        line = (str(e).strip().splitlines() or [""])[0]
        return f"an expert's forward takes more than the tokens and their routing weights ({line})"
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    output = next(n for n in traced.graph.nodes if n.op == "output")
    scaled = output.args[0]
    if not (
        len(placeholders) == 2
        and isinstance(scaled, Node)
        and scaled.target in (operator.mul, torch.mul)
        and len(scaled.args) == 2
        and placeholders[1] in scaled.args
        and list(placeholders[1].users) == [scaled]
        and len(scaled.users) == 1
    ):
        return "an expert's forward takes its routing weights other than as a last scaling of its output"
    mlp_out = next(a for a in scaled.args if a is not placeholders[1])
    output.args = (mlp_out,)
    traced.graph.erase_node(scaled)
    return traced


def routed(traced: Traced, path: str) -> tuple[Node, Node] | str:
    """(expert ids, routing weights): the indices of the block's top-k over the experts (the
    widest, when group top-ks come first: DeepSeek's Hub gate), and the values it hands the
    experts (the top-k's values, or the scores gathered at its indices, up to what the
    per-expert loop indexes), or why not."""
    inside = set(traced.nodes_in(path))
    topks = [n for n in inside if n.target is torch.topk or (n.op == "call_method" and n.target == "topk")]
    widths = {n: value(n.args[0]).shape[-1] if torch.is_tensor(value(n.args[0])) else 0 for n in topks}
    widest = [n for n in topks if widths[n] == max(widths.values(), default=0)]
    if len(widest) != 1 or (len(topks) > 1 and any(value(n.args[0]).dim() > 2 for n in widest)):
        return f"{len(topks)} top-k choices of experts instead of one"
    picks = {u.args[1]: u for u in widest[0].users if u.target is operator.getitem and u.users}
    gathered = [u for u in picks.get(1, widest[0]).users if _gathers_at(u, picks.get(1))]
    if 1 not in picks or (0 not in picks and len(gathered) != 1):
        return "the top-k's values and indices are not both used"
    weights = picks[0] if 0 in picks else gathered[0]
    # a router module's top-k: its weights are what it returns (DeepSeek's MoEGate)
    router = [
        c for c, _ in traced.module.get_submodule(path).named_children() if weights in _nodes(traced, path, c)
    ]
    walk = set(_nodes(traced, path, router[0])) if router else inside
    while (after := _next_weight(weights)) is not None and after in walk:
        weights = after
    return picks[1], weights


def _nodes(traced: Traced, path: str, child: str) -> list[Node]:
    return traced.nodes_in(f"{path}.{child}" if path else child)


def _gathers_at(node: Node, index: Node | None) -> bool:
    """``scores.gather(1, index)`` (or ``torch.gather``)."""
    return node.target in ("gather", torch.gather) and len(node.args) == 3 and node.args[2] is index


def _next_weight(node: Node) -> Node | None:
    """The one next step of the routing weights before the experts' loop indexes them:
    the only user, or the only one of the same shape beside reductions of it (the sum a
    renormalisation divides by)."""
    users = list(node.users)
    if any(_indexes(u, node) or "value" not in u.meta for u in users):
        return None
    if len(users) == 1:
        return users[0]
    shape = value(node).shape if torch.is_tensor(value(node)) else None
    same = [u for u in users if torch.is_tensor(value(u)) and value(u).shape == shape]
    return same[0] if shape is not None and len(same) == 1 else None


def _indexes(node: Node, source: Node) -> bool:
    """``node`` gathers rows of ``source`` (``weights[token_idx, slot, None]``)."""
    return node.target is operator.getitem and node.args[0] is source and isinstance(node.args[1], tuple)


def expert_weights(experts: nn.Module, mlp: MlpPlan | None) -> tuple[list, list, list]:
    """Per expert: gate [I, H], up [I, H], down [H, I] weights, from stacked experts
    (``gate_up_proj`` [E, 2I, H] as [gate; up], ``down_proj`` [E, H, I]) or from the
    modules of a ModuleList (``mlp``: their MLP facts)."""
    if mlp is None:
        gate, up = experts.gate_up_proj.chunk(2, dim=1)
        return list(gate), list(up), list(experts.down_proj)
    return (
        [getattr(e, mlp.gate.attr).weight for e in experts],
        [getattr(e, mlp.up.attr).weight for e in experts],
        [getattr(e, mlp.down.attr).weight for e in experts],
    )


def int_attr(module: nn.Module, size: int) -> str | None:
    """The attribute of ``module`` holding the int ``size`` (top_k, a width...), when exactly one
    does; attributes ``__init__`` assigns from another of them (Llama-4's ``self.expert_dim =
    self.intermediate_size``) are that one."""
    found = [
        name
        for name, v in vars(module).items()
        if not name.startswith("_") and isinstance(v, int) and not isinstance(v, bool) and v == size
    ]
    assigned = init_assignments(type(module))
    originals = [name for name in found if not _assigned_from_self(assigned.get(name), found)]
    return originals[0] if len(originals) == 1 else None


def _assigned_from_self(value: ast.expr | None, names: list[str]) -> bool:
    """``value`` is ``self.<one of names>``."""
    return (
        isinstance(value, ast.Attribute)
        and isinstance(value.value, ast.Name)
        and value.value.id == "self"
        and value.attr in names
    )


def flat_experts(block: nn.Module, router: str, num_experts: int) -> str | None:
    """The block's child holding its experts as flat 2-D parameters (dbrx's
    ``DbrxExperts``: ``mlp.w1``/``v1``/``w2``, each ``[E * I, H]``): exactly three
    parameters of one shape whose rows split into ``num_experts`` blocks; else None."""
    found = []
    for name, child in block.named_children():
        params = [p for _, p in child.named_parameters()]
        if (
            name != router
            and len(params) == 3
            and all(p.dim() == 2 and p.shape == params[0].shape for p in params)
            and params[0].shape[0] % num_experts == 0
        ):
            found.append(name)
    return found[0] if len(found) == 1 else None


def flat_roles(experts: nn.Module) -> list[tuple[str, str, str]]:
    """Every (gate, up, down) assignment of the three flat parameters; the replay keeps the
    one that reproduces the block."""
    names = [n for n, _ in experts.named_parameters()]
    return [(g, u, d) for g in names for u in names for d in names if len({g, u, d}) == 3]


def flat_weights(
    experts: nn.Module, roles: tuple[str, str, str], num_experts: int
) -> tuple[list, list, list]:
    """Per expert gate [I, H], up [I, H] and down [H, I] from flat ``[E * I, H]``
    parameters (the down one holds each expert's projection transposed, ``x @ w2[e]``)."""
    gate, up, down = (experts.get_parameter(r) for r in roles)
    gate, up, down = (list(p.view(num_experts, -1, p.shape[1])) for p in (gate, up, down))
    return gate, up, [d.T for d in down]


def returned_index(block: nn.Module, traced: Traced, path: str, x: torch.Tensor) -> int | None | str:
    """None when the block returns its output tensor; the index of the tensor the layer
    reads when it returns a tuple (gpt_oss: (hidden states, router scores)); or why not."""
    if not traced.returns_tuple.get(path, False):
        return None
    (used,) = traced.outputs_of(path)
    with torch.no_grad():
        returned = block(x)
    found = [
        i
        for i, r in enumerate(returned)
        if torch.is_tensor(r) and r.shape == value(used).shape and torch.equal(r, value(used))
    ]
    return found[0] if len(found) == 1 else "the block returns a tuple the layer reads no one element of"
