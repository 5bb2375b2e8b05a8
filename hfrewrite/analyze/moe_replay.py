"""vLLM's fused MoE for a ``MoePlan``, computed on the block's own weights: the output
analyze/moe.py's replay compares with the block's (routing by analyze/routing.py's
reference router, then each expert's gated MLP and the shared expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from hfrewrite.analyze.moe_modules import expert_weights, flat_weights
from hfrewrite.analyze.plan import MoePlan
from hfrewrite.analyze.routing import route

# vLLM's "swigluoai" (gpt_oss): clamped gate and up, gate * sigmoid(alpha * gate) * (up + 1)
# at the limit and alpha its kernels use.
SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT = 1.702, 7.0


def correction_bias(block: nn.Module, plan: MoePlan) -> torch.Tensor | None:
    """The score-correction bias (a parameter or buffer of the block, its router or a child), if any."""
    return dict([*block.named_parameters(), *block.named_buffers()]).get(plan.correction_bias)


def _gated(activation: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The experts' gated activation as vLLM's fused MoE computes it."""
    if activation == "swigluoai":
        gate = gate.clamp(max=SWIGLUOAI_LIMIT)
        up = up.clamp(min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT)
        return gate * torch.sigmoid(gate * SWIGLUOAI_ALPHA) * (up + 1)
    return ACT2FN[activation](gate) * up


def replay_error(block: nn.Module, plan: MoePlan, x: torch.Tensor) -> float | None:
    """How far vLLM's output for ``plan`` on ``x`` is from the block's, or None when close."""
    x2 = x.reshape(-1, x.shape[-1])
    experts = block.get_submodule(plan.experts)
    router = block.get_submodule(plan.router)
    if plan.carried_router:
        with torch.no_grad():
            routed = router(x2)
        w, idx = (routed[i] for i in plan.carried_router)
    else:
        linear = router.get_submodule(plan.router_linear) if plan.router_linear else router
        logits = F.linear(x2, linear.weight, linear.bias if plan.router_bias else None)
        correction = correction_bias(block, plan)
        w, idx = route(logits, plan, None if correction is None else correction.reshape(-1))
    w = w.to(x2.dtype)
    out = torch.zeros_like(x2)
    biases = [(None, None, None)] * plan.num_experts
    if plan.flat_experts:
        gate_w, up_w, down_w = flat_weights(experts, plan.flat_experts, plan.num_experts)
    elif plan.expert_mlp is None:
        gate_w, up_w, down_w, found = plan.experts_layout.weights(experts)
        biases = found if plan.experts_bias else biases
    else:
        gate_w, up_w, down_w = expert_weights(experts, plan.expert_mlp)
    for e in range(plan.num_experts):
        rows, slot = torch.where(idx == e)
        if len(rows) == 0:
            continue
        h, weight = x2[rows], w[rows, slot, None]
        if plan.weights_on_input:  # the weight scales the expert's input, not its output
            h, weight = h * weight, 1.0
        gate_b, up_b, down_b = biases[e]
        inner = _gated(plan.activation, F.linear(h, gate_w[e], gate_b), F.linear(h, up_w[e], up_b))
        y = F.linear(inner, down_w[e], down_b)
        out.index_add_(0, rows, y * weight)
    if plan.shared_expert:
        shared = block.get_submodule(plan.shared_expert)(x2)
        if plan.shared_expert_gate:
            shared = torch.sigmoid(block.get_submodule(plan.shared_expert_gate)(x2)) * shared
        out = out + shared
    if plan.output_module:
        with torch.no_grad():
            out = block.get_submodule(plan.output_module)(out)
    with torch.no_grad():
        got = block(x)
    got = (got if plan.output_index is None else got[plan.output_index]).reshape(-1, x.shape[-1])
    if torch.allclose(got, out, rtol=1e-4, atol=1e-5):
        return None
    return (got - out).abs().max().item()
