"""Load the original Hugging Face checkpoint into the fused layers.

Matches the causal-LM class produced by ``vllm_model_interface`` and the fusions the plan
allows (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``).

Emits the class attributes vLLM's ``llama.py`` declares::

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_stacked={".q_proj": (".qkv_proj", "q"), ...})
    embedding_modules = {"embed_tokens": "input_embeddings", "lm_head": "output_embeddings"}

``load_weights`` (from the template) hands the checkpoint to ``AutoWeightsLoader`` with that
mapper, so each HF tensor lands in its shard of the fused parameter, under tensor parallel
too; a tied ``lm_head`` is skipped by the loader.

Preconditions: the causal-LM class has ``load_weights`` reading ``self.hf_to_vllm_mapper``.
"""

from __future__ import annotations

import libcst as cst

from hfrewrite import cst_tools as t
from hfrewrite.errors import HfrewriteError
from hfrewrite.pass_api import FusionRow, PassContext, PassResult

NAME = "load_weights"


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    plan = ctx.plan
    att, mlp = plan.attention, plan.mlp
    stacks = {
        "qkv_proj": [(att.q.attr, '"q"'), (att.k.attr, '"k"'), (att.v.attr, '"v"')],
        "gate_up_proj": [(mlp.gate.attr, "0"), (mlp.up.attr, "1")],
    }
    cls = t.find_class(module, plan.architecture)
    load = t.find_method(cls, "load_weights")
    if load is None or "hf_to_vllm_mapper" not in t.self_attrs_used(load):
        raise HfrewriteError(f"{plan.architecture}: {NAME}: no load_weights using self.hf_to_vllm_mapper")
    packed = ", ".join(f'"{fused}": [{", ".join(repr(s) for s, _ in parts)}]' for fused, parts in stacks.items())
    stacked = "".join(
        f'        ".{src}": (".{fused}", {shard}),\n' for fused, parts in stacks.items() for src, shard in parts
    )
    members = t.stmts(
        f"packed_modules_mapping = {{{packed}}}\n".replace("'", '"')
        + "# Hugging Face checkpoints keep the fused projections apart: each tensor is\n"
        "# loaded into its shard (weight_name: (param_name, shard_id)).\n"
        "hf_to_vllm_mapper = WeightsMapper(\n"
        f"    orig_to_new_stacked={{\n{stacked}    }}\n"
        ")\n"
        f'embedding_modules = {{"{plan.embed_tokens}": "input_embeddings", "{plan.lm_head}": "output_embeddings"}}\n'
    )
    body = list(cls.body.body)
    body[0] = body[0].with_changes(leading_lines=[cst.EmptyLine()])
    cls = cls.with_changes(body=cls.body.with_changes(body=[*members, *body]))
    return PassResult(
        module=t.replace_class(module, plan.architecture, cls),
        imports=("WeightsMapper",),
        fused=(FusionRow(plan.architecture, "load_weights: HF checkpoint names -> fused shards"),),
        matches=1,
    )
