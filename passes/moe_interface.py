"""Declare vLLM's ``MixtureOfExperts`` on the causal LM of a MoE model.

Matches the causal-LM class built by ``vllm_model_interface`` when the plan has a MoE block
(whose ``fuse_experts`` rewrite keeps the ``n_*_experts`` bookkeeping, as vLLM's blocks do).

Emits, from ``templates/moe.py`` (vLLM's ``qwen3_moe.py`` idiom): the ``MixtureOfExperts``
base; in ``__init__`` the list of the fused-MoE runners of the sparse layers
(``moe_layers``) and the expert counts vLLM's expert-parallel load balancer (EPLB) reads;
and ``update_physical_experts_metadata``.

Preconditions: the plan found a MoE block; the decoder layer's MLP attribute is the last
residual block; the causal LM holds the base model under the plan's attribute.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites
from hfrewrite.emit.templates_io import template_class

NAME = "moe_interface"


def _expert_groups(module: cst.Module, block: str) -> str:
    """The expert-group count the block hands its fused experts (``num_expert_group=``, the
    source's expression for it, as fuse_experts emitted it), else 1."""
    calls = (
        n
        for c in module.body
        if isinstance(c, cst.ClassDef) and c.name.value == block
        for n in t.walk(c)
        if isinstance(n, cst.Call) and t.call_name(n) == "FusedMoEFactory"
    )
    for call in calls:
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value == "num_expert_group":
                return t.code(arg.value)
    return "1"


def _declares_moe(causal: cst.ClassDef) -> bool:
    return any(m.matches(base.value, m.Name("MixtureOfExperts")) for base in causal.bases)


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    """The causal LM declares vLLM's ``MixtureOfExperts`` with its EPLB bookkeeping."""
    plan, moe = ctx.plan, ctx.plan.moe
    if moe is None or _declares_moe(t.find_class(module, plan.architecture)):  # (its own output)
        return PassResult(module=module)
    mlp_attr = plan.decoder_layer.mlp_block
    tpl = template_class(
        "moe.py",
        "TemplateMoeForCausalLM",
        {"TemplateSparseMoeBlock": moe.module_class},
        {
            "model": plan.base_model_attr,
            "layers": plan.layers,
            "mlp": mlp_attr,
            "experts": moe.experts,
        },
    )
    causal = t.find_class(module, plan.architecture)
    init = t.find_method(causal, "__init__")
    groups = _expert_groups(module, moe.module_class)
    extra = [
        t.stmt(f"self.num_expert_groups = {groups}\n")
        if t.self_attr_assigned(s) == "num_expert_groups"
        else s
        for s in t.find_method(tpl, "__init__").body.body
    ]
    extra[0] = extra[0].with_changes(leading_lines=[cst.EmptyLine(indent=False), *extra[0].leading_lines])
    causal = t.set_method(causal, t.with_body(init, [*init.body.body, *extra]))
    causal = t.set_method(causal, t.find_method(tpl, "update_physical_experts_metadata"))
    causal = causal.with_changes(bases=[*causal.bases, cst.Arg(cst.Name("MixtureOfExperts"))])
    sites = Sites()
    module = sites.replace_class(module, plan.architecture, causal)
    return PassResult(
        module=module,
        imports=("MixtureOfExperts", "PPMissingLayer"),
        fused=(
            FusionRow(
                plan.architecture,
                "MixtureOfExperts (expert-parallel load balancing bookkeeping)",
            ),
        ),
        matches=sites.count,
    )
