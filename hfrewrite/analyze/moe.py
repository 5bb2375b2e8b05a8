"""MoE facts: router -> softmax -> top-k -> (renormalise) -> stacked experts (+ shared expert).

Pattern (transformers 5.x, qwen2_moe/qwen3_moe/olmoe/mixtral)::

    logits = F.linear(x, router.weight)            # router: a module with `weight`, no bias
    probs = softmax(logits)                        # in float32
    w, idx = topk(probs, k)
    w = w / w.sum(-1, keepdim=True)                # optional (config-dependent)
    y = experts(x, idx, w)                         # leaf: stacked [E, 2I, H] / [E, H, I]
    y = y + sigmoid(shared_gate(x)) * shared(x)    # optional shared expert

Preconditions (fail closed): exactly one experts leaf, fed by one top-k over a softmax of
one bias-free router projection of the block input; the experts hold no biases and their
``gate_up_proj`` is ``[gate; up]`` concatenated (checked numerically); the block returns
one tensor. Finally the plan is replayed on the example input with a reference
implementation and must reproduce the block's output, so a router quirk the rules do not
see (scaling, jitter, bias correction, interleaving) refuses instead of converting.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node
from transformers.activations import ACT2FN

from hfrewrite.plan import MoePlan, NoMatch
from hfrewrite.trace import Traced, is_experts, relative, value

# Activations vLLM's fused MoE kernels take by name (vLLM 0.32 on CPU: silu).
MOE_ACTIVATIONS = ("silu", "swish")
_PASS_THROUGH = ("to", "float", "type_as", "contiguous")


def analyze_moe(traced: Traced, path: str, activation: str, config) -> MoePlan | NoMatch:
    """Facts of the MoE block at submodule ``path`` of a traced decoder layer."""
    block = traced.module.get_submodule(path)
    cls = type(block).__name__

    def no(reason: str) -> NoMatch:
        return NoMatch("fuse_experts", cls, reason)

    nodes = traced.nodes_in(path)
    experts_calls = [n for n in nodes if n.op == "call_module" and is_experts(traced.submodule(n))]
    if len(experts_calls) != 1:
        return no(f"{len(experts_calls)} stacked-experts modules instead of one")
    call = experts_calls[0]
    if len(call.args) != 3:
        return no("the experts are not called as experts(x, top_k_index, top_k_weights)")
    hidden, index, weights = call.args
    experts_mod = traced.submodule(call)

    renormalize = False
    node = _skip(weights)
    if _is_div(node):
        numerator, denominator = node.args
        if not (_is_sum_of(denominator, _skip(numerator))):
            return no("the top-k weights are divided by something other than their sum")
        renormalize, node = True, _skip(numerator)
    if not (_is_getitem(node, 0) and _is_getitem(_skip(index), 1) and node.args[0] is _skip(index).args[0]):
        return no("the experts' index and weights are not the two outputs of one top-k")
    topk = node.args[0]
    if not (topk.op == "call_function" and topk.target is torch.topk):
        return no("routing does not use torch.topk")
    top_k = value(topk.args[1]) if len(topk.args) > 1 else topk.kwargs.get("k")
    scores = topk.args[0]
    scoring = _scoring(scores)
    if scoring != "softmax":
        return no(f"router scoring is {scoring}, not softmax over the router logits")
    logits = _skip(scores.args[0])
    if not (logits.op == "call_function" and logits.target is F.linear):
        return no("router logits are not F.linear(x, router.weight)")
    if len(logits.args) > 2 or logits.kwargs.get("bias") is not None:
        return no("the router has a bias")
    weight = logits.args[1]
    if not (isinstance(weight, Node) and weight.op == "get_attr"):
        return no("router weight is not a module parameter")
    router = relative(weight.target, path).rsplit(".", 1)[0]
    if _root(logits.args[0]) is not _root(hidden):
        return no("router and experts read different inputs")
    if activation not in MOE_ACTIVATIONS:
        return no(f"vLLM's fused MoE has no {activation!r} activation here")
    if any(n.endswith("bias") for n, _ in experts_mod.named_parameters()):
        return no("the experts have biases")

    shared, shared_gate = _shared_expert(traced, path, cls, call)
    if isinstance(shared, NoMatch):
        return shared
    if len(traced.outputs_of(path)) != 1:
        return no("the block returns more than one tensor")

    num_experts = experts_mod.gate_up_proj.shape[0] if hasattr(experts_mod, "gate_up_proj") else None
    if num_experts is None or not hasattr(experts_mod, "down_proj"):
        return no("the experts do not hold gate_up_proj and down_proj")
    plan = MoePlan(
        module_class=cls,
        router=router,
        router_class=type(block.get_submodule(router)).__name__,
        experts=relative(call.target, path),
        experts_class=type(experts_mod).__name__,
        num_experts=int(num_experts),
        top_k=int(top_k),
        scoring=scoring,
        renormalize=renormalize,
        activation=activation,
        shared_expert=shared,
        shared_expert_gate=shared_gate,
    )
    mismatch = _replay(block, plan, value(_root(hidden)))
    return no(mismatch) if mismatch else plan


def _skip(node):
    """Step back over dtype casts and copies."""
    while isinstance(node, Node) and node.op == "call_method" and node.target in _PASS_THROUGH:
        node = node.args[0]
    return node


def _root(node):
    """Step back over reshapes to the tensor they view."""
    while isinstance(node, Node) and node.op == "call_method" and node.target in ("view", "reshape", *_PASS_THROUGH):
        node = node.args[0]
    return node


def _is_getitem(node, i: int) -> bool:
    return isinstance(node, Node) and node.target is operator.getitem and node.args[1] == i


def _is_div(node) -> bool:
    return isinstance(node, Node) and node.target in (operator.truediv, operator.itruediv, torch.div, "div", "div_")


def _is_sum_of(node, of) -> bool:
    return isinstance(node, Node) and node.op == "call_method" and node.target == "sum" and node.args[0] is of


def _scoring(node) -> str:
    if isinstance(node, Node) and node.target in (F.softmax, torch.softmax, "softmax"):
        return "softmax"
    if isinstance(node, Node) and node.target in (torch.sigmoid, F.sigmoid, "sigmoid"):
        return "sigmoid"
    return str(node.target) if isinstance(node, Node) else type(node).__name__


def _shared_expert(traced: Traced, path: str, cls: str, experts_call: Node):
    """(shared expert attr, sigmoid gate attr) when the block adds one to the experts'
    output, (None, None) when it does not, or a NoMatch."""
    inside = set(traced.nodes_in(path))
    adds = [u for u in _users_through_views(experts_call)
            if u in inside and u.target in (operator.add, torch.add, operator.iadd)]
    if not adds:
        return None, None
    add = adds[0]
    other = next(a for a in add.args if _root(a) is not experts_call and a is not experts_call)
    gate = None
    if isinstance(other, Node) and other.target in (operator.mul, torch.mul):
        sig = next((a for a in other.args if isinstance(a, Node) and _scoring(a) == "sigmoid"), None)
        if sig is None:
            return NoMatch("fuse_experts", cls, "the shared expert is scaled by something other than a sigmoid gate"), None
        gate_call = sig.args[0]
        if not (gate_call.op == "call_module" and isinstance(traced.submodule(gate_call), nn.Linear)):
            return NoMatch("fuse_experts", cls, "the shared expert gate is not a Linear"), None
        gate = relative(gate_call.target, path)
        other = next(a for a in other.args if a is not sig)
    if not (isinstance(other, Node) and other.op == "call_module"):
        return NoMatch("fuse_experts", cls, "the experts' output is added to something that is not a shared expert"), None
    shared = relative(other.target, path).split(".")[0]
    return shared, gate


def _users_through_views(node: Node) -> list[Node]:
    users, todo = [], list(node.users)
    while todo:
        u = todo.pop(0)
        if u.op == "call_method" and u.target in ("view", "reshape"):
            todo.extend(u.users)
        else:
            users.append(u)
    return users


def _replay(block: nn.Module, plan: MoePlan, x: torch.Tensor) -> str | None:
    """Reason the plan does not reproduce ``block(x)``, or None when it does."""
    x2 = x.reshape(-1, x.shape[-1])
    experts = block.get_submodule(plan.experts)
    router_w = block.get_submodule(plan.router).weight
    probs = torch.softmax(F.linear(x2, router_w).float(), dim=-1)
    w, idx = torch.topk(probs, plan.top_k, dim=-1)
    if plan.renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    w = w.to(x2.dtype)
    act = ACT2FN[plan.activation]
    out = torch.zeros_like(x2)
    gate_w, up_w = experts.gate_up_proj.chunk(2, dim=1)  # [E, I, H] each: gate rows first
    for e in range(plan.num_experts):
        rows, slot = torch.where(idx == e)
        if len(rows) == 0:
            continue
        h = x2[rows]
        y = F.linear(act(F.linear(h, gate_w[e])) * F.linear(h, up_w[e]), experts.down_proj[e])
        out.index_add_(0, rows, y * w[rows, slot, None])
    if plan.shared_expert:
        shared = block.get_submodule(plan.shared_expert)(x2)
        if plan.shared_expert_gate:
            shared = torch.sigmoid(block.get_submodule(plan.shared_expert_gate)(x2)) * shared
        out = out + shared
    with torch.no_grad():
        got = block(x).reshape(-1, x.shape[-1])
    if not torch.allclose(got, out, rtol=1e-4, atol=1e-5):
        err = (got - out).abs().max().item()
        return f"replaying the plan (softmax top-{plan.top_k}, renormalize={plan.renormalize}, [gate; up] experts) differs from the block by {err:.2e}"
    return None
