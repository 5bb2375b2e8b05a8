"""MLP facts: the gated ``down(act(gate(x)) * up(x))`` block.

Pattern (llama family): ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, which vLLM
writes as ``down_proj(act_and_mul(gate_up_proj(x)))``.

Preconditions (fail closed): the block's one output is a Linear (down) reading a product
of ``act(gate(x))`` and ``up(x)``; gate and up are Linears on the same x, each called
once, with equal out_features and bias; act is a module attribute of the block, of the
class transformers builds for the config's activation, and vLLM has an ``*AndMul`` for it.
"""

from __future__ import annotations

import operator

import torch
from transformers.activations import ACT2FN

from hfrewrite.plan import MlpPlan, NoMatch
from hfrewrite.trace import Traced, relative

# Keys of vllm.model_executor.layers.activation._ACTIVATION_AND_MUL_REGISTRY (vLLM 0.32)
# whose math is ``act(gate) * up``; "swigluoai" (clamped, gpt-oss) and "geglu" (no
# transformers ACT2FN entry) are left out. Hard-coded so analysis does not import vLLM.
ACT_AND_MUL = ("gelu", "gelu_pytorch_tanh", "silu", "swish")

_MUL = (operator.mul, torch.mul, "mul")


def analyze_mlp(traced: Traced, path: str, activation: str) -> MlpPlan | NoMatch:
    """Facts of the MLP submodule ``path``; ``activation`` is the config's name for it."""
    cls = type(traced.module.get_submodule(path)).__name__

    def no(reason: str) -> NoMatch:
        return NoMatch("fuse_gate_up", cls, reason)

    linears = traced.linears_in(path)
    names = [relative(n.target, path) for n in linears]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        return no(f"{', '.join(repeated)} called more than once")
    outputs = traced.outputs_of(path)
    if len(outputs) != 1 or outputs[0] not in linears:
        return no("the block output is not one linear projection")
    down = outputs[0]
    product = down.args[0]
    if not (
        product.op in ("call_function", "call_method")
        and product.target in _MUL
        and len(product.args) == 2
        and not product.kwargs
    ):
        return no(
            f"{relative(down.target, path)} does not read a product act(gate(x)) * up(x)"
        )
    for act, up in (product.args, product.args[::-1]):
        if (
            act.op == "call_module"
            and act.args
            and act.args[0] in linears
            and up in linears
            and act.args[0] is not up
        ):
            gate = act.args[0]
            break
    else:
        return no(
            "the product is not act(linear(x)) * linear(x) with the activation a module attribute"
        )
    if gate.args[0] is not up.args[0]:
        return no("gate and up projections read different inputs")
    g, u, d = (traced.linear_fact(n, path) for n in (gate, up, down))
    if g.out_features != u.out_features or g.bias != u.bias:
        return no(f"{g.attr} and {u.attr} differ in out_features or bias")
    act_module = traced.submodule(act)
    if activation not in ACT_AND_MUL:
        return no(f"vLLM has no fused *AndMul for activation {activation!r}")
    if type(act_module) is not type(ACT2FN[activation]):
        return no(
            f"{relative(act.target, path)} is {type(act_module).__name__}, not the config's {activation!r}"
        )
    return MlpPlan(cls, g, u, d, relative(act.target, path), activation)
