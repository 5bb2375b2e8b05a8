"""MoE blocks that weight the experts' input (Llama-4's ``Llama4TextMoe``): every expert runs
on every token, its input scaled by the token's routing weight for it (0 where the router did
not choose it), and the block sums what the experts return, plus a shared expert::

    scores, logits = router(x)               # [T, E]: sigmoid of the top-k logits, 0 elsewhere
    y = experts(x.repeat(E, 1) * scores.T.reshape(-1, 1)).view(E, T, H).sum(0)
    out = shared(x) + y

vLLM's fused MoE computes this with ``apply_router_weight_on_input=True``: each chosen expert
runs on its weight times the input. Read here off the graph and its values: the router is the
block's one Linear from the hidden size to one logit per expert, run on the block's input; the
experts' one input holds each token once per expert, nonzero for exactly k of them (the
chosen); the shared expert is the block's one other child. The replay (analyze/moe.py) then
proves the rest against the block: the scoring, the experts' layout, that experts not chosen
add nothing, the sum and the shared expert. vLLM weights the input for one expert per token
only, so a config choosing more is refused.
"""

from __future__ import annotations

import ast

from torch import nn
from torch.fx import Node

from hfrewrite.analyze.branches import config_branches, init_assignments
from hfrewrite.analyze.expert_layouts import ExpertLayout
from hfrewrite.analyze.moe_modules import int_attr
from hfrewrite.analyze.plan import MoePlan, NoMatch
from hfrewrite.analyze.router_scorings import Scoring
from hfrewrite.analyze.routing import root
from hfrewrite.analyze.trace import Traced, relative, value

PATTERN = "fuse_experts"


def input_weighted_plan(
    traced: Traced, path: str, call: Node, activation: str, config
) -> tuple[MoePlan, Node] | NoMatch:
    """The plan (to be replayed) of the block at ``path`` whose experts ``call`` takes one
    tensor, and the block input it routes; or why the block is not that form."""
    block = traced.module.get_submodule(path)
    cls = type(block).__name__
    experts = traced.submodule(call)
    if not (hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj")):
        return NoMatch(PATTERN, cls, "the experts do not hold gate_up_proj and down_proj")
    if any(name.endswith("bias") for name, _ in experts.named_parameters()):
        return NoMatch(PATTERN, cls, "experts with biases are called on every token's weighted input")
    num_experts, width = int(experts.gate_up_proj.shape[0]), value(call.args[0]).shape[-1]
    router_call = _router_call(traced, path, num_experts, width)
    if router_call is None:
        return NoMatch(PATTERN, cls, "no one Linear child of the block gives one logit per expert")
    hidden = root(router_call.args[0])
    if hidden in set(traced.nodes_in(path)):
        return NoMatch(PATTERN, cls, "the router does not read the block's input")
    top_k = _chosen_per_token(value(call.args[0]), num_experts, width)
    if isinstance(top_k, str):
        return NoMatch(PATTERN, cls, top_k)
    router_attr = relative(router_call.target, path)
    router = block.get_submodule(router_attr)
    one = _one_expert_per_token(block, router_attr, top_k, config)
    if one is not None:
        return NoMatch(PATTERN, cls, one)
    shared = _shared_child(traced, path, {router_attr, relative(call.target, path)})
    if isinstance(shared, NoMatch):
        return shared
    transposed = experts.gate_up_proj.shape[1] == width != experts.gate_up_proj.shape[2]
    intermediate = experts.down_proj.shape[1 if transposed else 2]
    plan = MoePlan(
        module_class=cls,
        router=router_attr,
        router_class=type(router).__name__,
        experts=relative(call.target, path),
        experts_class=type(experts).__name__,
        num_experts=num_experts,
        top_k=top_k,
        scoring=Scoring.SIGMOID,  # the replay tries softmax as well
        renormalize=False,
        activation=activation,
        shared_expert=shared,
        shared_expert_gate=None,
        router_bias=router.bias is not None,
        experts_layout=ExpertLayout.of(transposed, interleaved=False),
        size_attrs=tuple(int_attr(experts, size) for size in (num_experts, width, intermediate)),
        router_branches=config_branches(router),
        weights_on_input=True,
    )
    return plan, hidden


def _router_call(traced: Traced, path: str, num_experts: int, width: int) -> Node | None:
    """The call of the block's one ``nn.Linear`` child from ``width`` to ``num_experts``. A
    subclass may route in its own forward (Llama4Router): the replay computes its logits
    with ``F.linear`` and checks the block's output, not the router's."""
    routers = [
        n
        for n in traced.nodes_in(path)
        if n.op == "call_module"
        and "." not in relative(n.target, path)
        and isinstance(module := traced.submodule(n), nn.Linear)
        and (module.out_features, module.in_features) == (num_experts, width)
    ]
    return routers[0] if len(routers) == 1 else None


def _chosen_per_token(routed, num_experts: int, width: int) -> int | str:
    """k, when the experts' input ``routed`` holds each of T tokens once per expert
    (``[E * T, H]``, expert-major) and exactly k of each token's E copies are nonzero."""
    if routed.dim() != 2 or routed.shape[0] % num_experts:
        return "the experts' input is not each token once per expert"
    chosen = routed.reshape(num_experts, -1, width).abs().amax(dim=-1) > 0  # [E, T]
    counts = chosen.sum(dim=0).unique()
    if len(counts) != 1 or not 0 < int(counts[0]) < num_experts:
        return "the experts' input is not the tokens weighted for the same number of experts each"
    return int(counts[0])


def _one_expert_per_token(block, router_attr: str, top_k: int, config) -> str | None:
    """Why vLLM cannot weight this config's experts' input (it does so for top-1 only), or
    None: the attribute holding top_k is set from a config field, which is 1 on ``config``."""
    for owner in (block.get_submodule(router_attr), block):
        attr = int_attr(owner, top_k)
        source = init_assignments(type(owner)).get(attr) if attr else None
        if (
            isinstance(source, ast.Attribute)
            and isinstance(source.value, ast.Name)
            and source.value.id == "config"
        ):
            chosen = getattr(config, source.attr, None)
            if chosen == 1:
                return None
            return (
                f"config.{source.attr} is {chosen}: vLLM's fused MoE weights the experts' input "
                "for one expert per token only"
            )
    return f"no attribute set from a config field holds top_k ({top_k})"


def _shared_child(traced: Traced, path: str, routing: set[str]) -> str | None | NoMatch:
    """The block's one child called beside its router and experts (the shared expert), or None."""
    called = {
        relative(n.target, path).split(".")[0]
        for n in traced.nodes_in(path)
        if n.op == "call_module" and n.target != path
    }
    others = sorted(called - routing)
    if len(others) > 1:
        return NoMatch(
            PATTERN,
            type(traced.module.get_submodule(path)).__name__,
            f"children {others} beside the router and experts",
        )
    return others[0] if others else None
