"""MoE facts: router -> routing -> stacked experts (+ shared expert), proven by replay.

Pattern (transformers 5.x: qwen2_moe, qwen3_moe, olmoe, mixtral; deepseek_v3, glm4_moe, dots1)::

    w, idx = routing(F.linear(x, router.weight))   # analyze/routing.py: softmax or sigmoid,
                                                   # bias correction, grouped top-k, scaling
    y = experts(x, idx, w)                         # leaf: stacked [E, 2I, H] / [E, H, I]
    y = y + [sigmoid(shared_gate(x)) *] shared(x)  # optional shared expert

Routing none of those facts expresses (phimoe's sparsemixer) is carried: when the experts'
weights and ids are two outputs of one leaf child of the block called on its input, that
child runs as the source has it, as the fused experts' custom routing function; the replay
then proves the rest (router outputs -> fused experts -> shared expert) on its outputs.

Preconditions (fail closed): exactly one experts leaf, fed by the routing of one router
projection of the block input; the experts hold no biases and their ``gate_up_proj`` is
``[gate; up]`` concatenated; the block returns one tensor. Finally the plan is replayed
with a reference implementation (vLLM's router arithmetic, the correction bias
randomised) and must reproduce the block's output, so a router quirk the rules do not see
(jitter, interleaving, a bias added after the choice) refuses instead of converting.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

from hfrewrite.analyze.branches import config_branches, init_assignments, init_switches, with_config_attrs
from hfrewrite.analyze.expert_layouts import ExpertLayout
from hfrewrite.analyze.input_weighted_moe import input_weighted_plan
from hfrewrite.analyze.leaf_modules import is_experts
from hfrewrite.analyze.moe_modules import (
    expert_list,
    expert_mlp,
    flat_experts,
    flat_roles,
    int_attr,
    returned_index,
    routed,
)
from hfrewrite.analyze.moe_replay import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, correction_bias, replay_error
from hfrewrite.analyze.plan import MoePlan, NoMatch
from hfrewrite.analyze.router_scorings import Scoring
from hfrewrite.analyze.routing import (
    config_attrs,
    output_scale,
    root,
    router_facts,
    scoring_of,
    skip,
    users_through_views,
)
from hfrewrite.analyze.trace import Traced, relative, value

# Activations vLLM's fused MoE kernels take by name (vLLM 0.32 on CPU: silu).
MOE_ACTIVATIONS = ("silu", "swish", "swigluoai")
PATTERN = "fuse_experts"


def analyze_moe(traced: Traced, path: str, activation: str, config) -> MoePlan | NoMatch:
    """Facts of the MoE block at submodule ``path`` of a traced decoder layer."""
    block = traced.module.get_submodule(path)
    cls = type(block).__name__
    nodes = traced.nodes_in(path)
    experts_calls = [n for n in nodes if n.op == "call_module" and is_experts(traced.submodule(n))]
    if not experts_calls and (attr := expert_list(block)) is not None:
        return _expert_modules(traced, path, block, attr, config)
    if not experts_calls and (flat := _flat_experts(traced, path, block)) is not None:
        return flat
    if len(experts_calls) != 1:
        return NoMatch(PATTERN, cls, f"{len(experts_calls)} stacked-experts modules instead of one")
    call = experts_calls[0]
    if len(call.args) == 1 and not call.kwargs:  # Llama-4: experts on every token, input weighted
        return _input_weighted(traced, path, call, activation, config)
    if len(call.args) != 3:
        return NoMatch(
            PATTERN,
            cls,
            "the experts are not called as experts(x, top_k_index, top_k_weights)",
        )
    hidden, index, weights = call.args
    experts_mod = traced.submodule(call)

    facts = router_facts(traced, path, block, index, weights, hidden)
    if isinstance(facts, str):
        facts = _carried_router(traced, path, index, weights, hidden) or facts
    if isinstance(facts, str):
        return NoMatch(PATTERN, cls, facts)
    # the config's activation, or gpt_oss's clamped swiglu (which the replay tells apart); a
    # config naming none (LFM2-MoE's experts call F.silu themselves): silu, proven the same way
    activations = [a for a in (activation or "silu", "swigluoai") if a in MOE_ACTIVATIONS]
    biases = {n for n, _ in experts_mod.named_parameters() if n.endswith("bias")}
    if biases not in (set(), {"gate_up_proj_bias", "down_proj_bias"}):
        return NoMatch(PATTERN, cls, f"the experts have biases {sorted(biases)}")
    plan = _stacked_plan(traced, path, call, facts, activations[0], bool(biases))
    if isinstance(plan, NoMatch):
        return plan
    plan = dataclasses.replace(plan, init_switches=_block_switches(block, config))
    return _replayed(block, plan, experts_mod, value(root(hidden)), activations, activation)


def _block_switches(block: nn.Module, config) -> tuple[tuple[str, bool], ...]:
    """The block's ``__init__`` switches, on the config or on attributes set from it
    (LFM2-MoE's ``if self.use_expert_bias:`` building its correction bias)."""
    assigned = init_assignments(type(block))
    return init_switches(block, config, lambda test: with_config_attrs(test, assigned))


def _input_weighted(traced: Traced, path: str, call: Node, activation: str, config) -> MoePlan | NoMatch:
    """A block calling its experts on every token's weighted input (analyze/input_weighted_moe.py),
    replayed with each scoring vLLM routes by: the first that reproduces the block."""
    block = traced.module.get_submodule(path)
    activation = activation or "silu"
    if activation not in MOE_ACTIVATIONS:
        return NoMatch(
            PATTERN, type(block).__name__, f"vLLM's fused MoE has no {activation!r} activation here"
        )
    found = input_weighted_plan(traced, path, call, activation, config)
    if isinstance(found, NoMatch):
        return found
    plan, hidden = found
    output_index = returned_index(block, traced, path, value(hidden))
    if isinstance(output_index, str):
        return NoMatch(PATTERN, plan.module_class, output_index)
    plan = dataclasses.replace(plan, output_index=output_index, init_switches=_block_switches(block, config))
    experts, x = traced.submodule(call), value(hidden)
    first = None
    for scoring in (Scoring.SIGMOID, Scoring.SOFTMAX):
        replayed = _replayed(
            block, dataclasses.replace(plan, scoring=scoring), experts, x, [activation], activation
        )
        if not isinstance(replayed, NoMatch):
            return replayed
        first = first or replayed
    return first


def _scaled_output(
    traced: Traced, path: str, block: nn.Module, call: Node, facts: dict
) -> tuple[Node, dict] | str:
    """The experts' output as the block goes on to read it, and the routing facts with the
    number the block scales it by as the routed scaling factor; or why not."""
    scaled = None if facts.get("carried_router") else output_scale(traced, path, call)
    if scaled is None:
        return call, facts
    output, scale = scaled  # minimax_m3: the block scales the experts' output
    attrs = config_attrs(block, facts["router"], {"routed_scaling_factor": scale})
    if facts["routed_scaling_factor"] != 1.0 or isinstance(attrs, str):
        return attrs if isinstance(attrs, str) else "the routed output is scaled twice"
    return output, {**facts, "routed_scaling_factor": scale, "config_attrs": facts["config_attrs"] + attrs}


def _stacked_plan(
    traced: Traced, path: str, call: Node, facts: dict, activation: str, experts_bias: bool
) -> MoePlan | NoMatch:
    """The plan of a block calling stacked experts (``call``) with the routing ``facts``:
    the shared expert, the experts' sizes and layout, the output the layer reads."""
    block = traced.module.get_submodule(path)
    cls = type(block).__name__
    hidden, experts_mod = call.args[0], traced.submodule(call)
    scaled = _scaled_output(traced, path, block, call, facts)
    if isinstance(scaled, str):
        return NoMatch(PATTERN, cls, scaled)
    output, facts = scaled
    shared, shared_gate = _shared_expert(traced, path, cls, output)
    if isinstance(shared, NoMatch):
        return shared
    if len(traced.outputs_of(path)) != 1:
        return NoMatch(PATTERN, cls, "the block returns more than one tensor")
    output_module = _output_module(traced, path, {facts["router"], shared, relative(call.target, path)})

    num_experts = experts_mod.gate_up_proj.shape[0] if hasattr(experts_mod, "gate_up_proj") else None
    if num_experts is None or not hasattr(experts_mod, "down_proj"):
        return NoMatch(PATTERN, cls, "the experts do not hold gate_up_proj and down_proj")
    output_index = returned_index(block, traced, path, value(root(hidden)))
    if isinstance(output_index, str):
        return NoMatch(PATTERN, cls, output_index)
    width = value(hidden).shape[-1]
    transposed = experts_mod.gate_up_proj.shape[1] == width != experts_mod.gate_up_proj.shape[2]
    intermediate = experts_mod.down_proj.shape[1 if transposed else 2]
    router = block.get_submodule(facts["router"])
    if type(router) is nn.Linear:  # the block's own Linear: the block routes, and holds top_k
        facts = {**facts, "top_k_attr": int_attr(block, facts["top_k"])}
    return MoePlan(
        module_class=cls,
        router_class=type(router).__name__,
        experts=relative(call.target, path),
        experts_class=type(experts_mod).__name__,
        num_experts=int(num_experts),
        activation=activation,
        experts_layout=ExpertLayout.of(transposed, interleaved=False),
        size_attrs=tuple(int_attr(experts_mod, size) for size in (int(num_experts), width, intermediate)),
        output_index=output_index,
        output_module=output_module,
        experts_bias=experts_bias,
        shared_expert=shared,
        shared_expert_gate=shared_gate,
        router_branches=()
        if facts.get("carried_router")
        else config_branches(block.get_submodule(facts["router"])),
        **facts,
    )


def _replayed(
    block: nn.Module,
    plan: MoePlan,
    experts: nn.Module,
    x: torch.Tensor,
    activations: list[str],
    activation: str,
) -> MoePlan | NoMatch:
    """The first variant of ``plan`` that replays the block, or why none does."""
    # The structure's renormalisation first; a softmax over the top-k logits replays as the
    # other. Gate and up as halves of gate_up_proj first, then interleaved (gpt_oss).
    first = None
    for act in activations:
        for interleaved in (False, True):
            candidate = dataclasses.replace(
                plan,
                activation=act,
                experts_layout=ExpertLayout.of(plan.experts_layout.transposed, interleaved),
                swiglu_attrs=_swiglu_attrs(experts) if act == "swigluoai" else None,
            )
            mismatch = _replay(block, candidate, x)
            if mismatch is None:
                return candidate
            first = first or mismatch
            if not plan.carried_router:
                other = dataclasses.replace(candidate, renormalize=not plan.renormalize)
                if _replay(block, other, x) is None:
                    return other
    if activation not in MOE_ACTIVATIONS:  # nor the clamped swiglu: the config's is the reason
        return NoMatch(PATTERN, plan.module_class, f"vLLM's fused MoE has no {activation!r} activation here")
    return NoMatch(PATTERN, plan.module_class, first)


def _expert_modules(traced: Traced, path: str, block: nn.Module, attr: str, config) -> MoePlan | NoMatch:
    """A block whose experts are a ModuleList of MLPs (moe_modules.py): routing facts,
    the experts' MLP and where top_k lives, then the same replay as stacked experts."""
    cls = type(block).__name__
    mlp = expert_mlp(block, attr, config)
    if isinstance(mlp, NoMatch):
        return mlp
    if mlp.activation not in MOE_ACTIVATIONS:
        return NoMatch(PATTERN, cls, f"vLLM's fused MoE has no {mlp.activation!r} activation here")
    picked = routed(traced, path)
    if isinstance(picked, str):
        return NoMatch(PATTERN, cls, picked)
    index, weights = picked
    shared = _modules_shared_expert(traced, path, cls, attr)
    if isinstance(shared, NoMatch):
        return shared
    modules = set(traced.linears_in(path))  # the router's, as nn.Linear or F.linear
    linears = [
        n
        for n in traced.nodes_in(path)
        if (n.op == "call_function" and n.target is F.linear)
        or (n in modules and relative(n.target, path).split(".")[0] not in (attr, shared))
    ]
    if len(linears) != 1:
        return NoMatch(PATTERN, cls, "the block holds linears beside its router, experts and shared expert")
    facts = router_facts(traced, path, block, index, weights, root(linears[0].args[0]))
    if isinstance(facts, str):
        return NoMatch(PATTERN, cls, facts)
    top_k_attr = int_attr(block, facts["top_k"])
    if top_k_attr is None:
        return NoMatch(PATTERN, cls, f"no one attribute of the block holds top_k ({facts['top_k']})")
    if len(traced.outputs_of(path)) != 1:
        return NoMatch(PATTERN, cls, "the block returns more than one tensor")
    x = value(root(linears[0].args[0]))
    output_index = returned_index(block, traced, path, x)
    if isinstance(output_index, str):
        return NoMatch(PATTERN, cls, output_index)
    experts = getattr(block, attr)
    plan = MoePlan(
        module_class=cls,
        router_class=type(block.get_submodule(facts["router"])).__name__,
        experts=attr,
        experts_class=type(experts[0]).__name__,
        num_experts=len(experts),
        activation=mlp.activation,
        shared_expert=shared,
        shared_expert_gate=None,
        init_switches=init_switches(block, config),
        checkpoint_expert_names=(mlp.gate.attr, mlp.down.attr, mlp.up.attr),
        expert_mlp=mlp,
        top_k_attr=top_k_attr,
        output_index=output_index,
        **facts,
    )
    mismatch = _replay(block, plan, x)
    if mismatch:
        other = dataclasses.replace(plan, renormalize=not plan.renormalize)
        if _replay(block, other, x) is None:
            return other
    return NoMatch(PATTERN, cls, mismatch) if mismatch else plan


def _modules_shared_expert(traced: Traced, path: str, cls: str, attr: str) -> str | None | NoMatch:
    """The shared expert a block of expert modules adds to its routed output (DeepSeek's Hub
    ``y = y + self.shared_experts(identity)``): the direct child called in the block's last
    add, or None."""
    outputs = traced.outputs_of(path)
    if len(outputs) != 1 or outputs[0].target not in (operator.add, torch.add, operator.iadd):
        return None
    children = [
        a
        for a in map(skip, outputs[0].args)
        if isinstance(a, Node) and a.op == "call_module" and relative(a.target, path).split(".")[0] != attr
    ]
    if len(children) != 1:
        return None
    routed_out = next(a for a in outputs[0].args if skip(a) is not children[0])
    shared, gate = _shared_expert(traced, path, cls, routed_out)
    if isinstance(shared, NoMatch) or gate is not None:
        return shared if isinstance(shared, NoMatch) else NoMatch(PATTERN, cls, "a gated shared expert")
    return shared


def _flat_experts(traced: Traced, path: str, block: nn.Module) -> MoePlan | NoMatch | None:
    """A block whose experts are three flat ``[E * I, H]`` parameters of one child (dbrx),
    routed by the block's one top-k over its one Linear: the routing facts, then the
    replay picks which parameter is gate, up and down (act(gate) * up is not symmetric;
    exactly one assignment may reproduce the block). None when the block is not that."""
    cls = type(block).__name__
    picked = routed(traced, path)
    linears = traced.linears_in(path)
    if isinstance(picked, str) or len(linears) != 1:
        return None
    router_linear = traced.submodule(linears[0])
    attr = flat_experts(block, relative(linears[0].target, path).split(".")[0], router_linear.out_features)
    if attr is None:
        return None
    index, weights = picked
    hidden = root(linears[0].args[0])
    facts = router_facts(traced, path, block, index, weights, hidden)
    if isinstance(facts, str):
        return NoMatch(PATTERN, cls, facts)
    top_k_attr = int_attr(block, facts["top_k"])
    if top_k_attr is None:
        return NoMatch(PATTERN, cls, f"no one attribute of the block holds top_k ({facts['top_k']})")
    if len(traced.outputs_of(path)) != 1:
        return NoMatch(PATTERN, cls, "the block returns more than one tensor")
    experts = block.get_submodule(attr)
    rows, width = next(experts.parameters()).shape
    sizes = (router_linear.out_features, width, rows // router_linear.out_features)
    size_attrs = [int_attr(experts, size) for size in sizes]
    if None in size_attrs:
        return NoMatch(
            PATTERN, cls, f"the experts module does not hold each of E, H, I {sizes} in one attribute"
        )
    base = MoePlan(
        module_class=cls,
        router_class=type(block.get_submodule(facts["router"])).__name__,
        experts=attr,
        experts_class=type(experts).__name__,
        num_experts=router_linear.out_features,
        activation="silu",  # the one vLLM's CPU fused MoE runs; the replay checks it
        shared_expert=None,
        shared_expert_gate=None,
        top_k_attr=top_k_attr,
        size_attrs=tuple(size_attrs),
        **facts,
    )
    x = value(hidden)
    found = [
        plan
        for roles in flat_roles(experts)
        for renormalize in (base.renormalize, not base.renormalize)
        if _replay(block, plan := dataclasses.replace(base, flat_experts=roles, renormalize=renormalize), x)
        is None
    ]
    if len(found) != 1:
        reason = "no" if not found else "more than one"
        return NoMatch(
            PATTERN, cls, f"{reason} assignment of its flat parameters to gate, up and down replays the block"
        )
    return found[0]


def _carried_router(traced: Traced, path: str, index, weights, hidden) -> dict | None:
    """Routing facts when the experts' weights and ids are two outputs of one call of a
    leaf child of the block on the block input (phimoe's sparsemixer router, an
    ``nn.Linear`` subclass): the emitted block runs that child as the source has it."""
    picks = []
    for node in (weights, index):
        if not (isinstance(node, Node) and node.target is operator.getitem and isinstance(node.args[1], int)):
            return None
        picks.append(node.args[1])
    call = weights.args[0]
    if call is not index.args[0] or call.op != "call_module" or picks[0] == picks[1]:
        return None
    router = relative(call.target, path)
    if "." in router or len(call.args) != 1 or call.kwargs or root(call.args[0]) is not root(hidden):
        return None
    return {
        "router": router,
        "top_k": int(value(index).shape[-1]),
        "scoring": Scoring.CARRIED,
        "renormalize": False,
        "carried_router": tuple(picks),
    }


def _shared_expert(traced: Traced, path: str, cls: str, experts_call: Node):
    """(shared expert attr, sigmoid gate attr) when the block adds one to the experts'
    output, (None, None) when it does not, or a NoMatch."""
    inside = set(traced.nodes_in(path))
    adds = [
        u
        for u in users_through_views(experts_call)
        if u in inside and u.target in (operator.add, torch.add, operator.iadd)
    ]
    if not adds:
        return None, None
    add = adds[0]
    # (hy_v3 adds the two in float32: casts are identities in the float32 analysis)
    # (AFMoE views the shared expert's [tokens, hidden] back to [batch, seq, hidden])
    other = root(next(a for a in add.args if root(a) is not experts_call and a is not experts_call))
    gate = None
    if isinstance(other, Node) and other.target in (operator.mul, torch.mul):
        sig = next(
            (a for a in other.args if isinstance(a, Node) and scoring_of(a) is Scoring.SIGMOID),
            None,
        )
        if sig is None:
            return NoMatch(
                PATTERN,
                cls,
                "the shared expert is scaled by something other than a sigmoid gate",
            ), None
        gate_call = sig.args[0]
        if not (gate_call.op == "call_module" and isinstance(traced.submodule(gate_call), nn.Linear)):
            return NoMatch(PATTERN, cls, "the shared expert gate is not a Linear"), None
        gate = relative(gate_call.target, path)
        other = root(next(a for a in other.args if a is not sig))
    if not (isinstance(other, Node) and other.op == "call_module"):
        return NoMatch(
            PATTERN,
            cls,
            "the experts' output is added to something that is not a shared expert",
        ), None
    shared = relative(other.target, path).split(".")[0]
    return shared, gate


def _output_module(traced: Traced, path: str, parts: set) -> str | None:
    """The block's own child (not the router, the experts or the shared expert), holding no
    Linear, whose call returns the block's output (A.X-K1's ``post_mlp_layernorm``), or None.
    The replay runs it on the fused experts' output: that proves where it stands."""
    (out,) = traced.outputs_of(path)
    if out.op != "call_module" or (attr := relative(out.target, path)) in parts or "." in attr:
        return None
    module = traced.submodule(out)
    return None if any(isinstance(m, nn.Linear) for m in module.modules()) else attr


def _replay(block: nn.Module, plan: MoePlan, x: torch.Tensor) -> str | None:
    """Reason the plan does not reproduce the block, or None when it does: on the traced
    input, then on a random one, each with a random correction bias when the router has
    one (its zero init would hide where it is added)."""
    bias = correction_bias(block, plan)
    saved = None if bias is None else bias.detach().clone()
    generator = torch.Generator().manual_seed(0)
    inputs = (x, torch.randn(x.shape, generator=generator, dtype=x.dtype) * x.std())
    try:
        for trial in inputs:
            if bias is not None:
                with torch.no_grad():
                    bias.copy_(torch.randn(bias.shape, generator=generator) * 0.1)
            err = replay_error(block, plan, trial)
            if err is not None:
                return f"replaying the plan ({plan.describe_routing()}, [gate; up] experts) differs from the block by {err:.2e}"
    finally:
        if bias is not None:
            with torch.no_grad():
                bias.copy_(saved)
    return None


def _swiglu_attrs(experts: nn.Module) -> tuple[str, str] | None:
    """The experts' attributes holding swigluoai's alpha and limit (one each), or None."""
    found = [
        [k for k, v in vars(experts).items() if type(v) is float and v == want]
        for want in (SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT)
    ]
    return (found[0][0], found[1][0]) if all(len(f) == 1 for f in found) else None
