"""Serve a multimodal checkpoint's text model: its text config, its text weights alone.

Matches a plan converted from a composite config (``ModelPlan.composite``: Llama-4's and
Gemma-3's released checkpoints nest the text model's config as ``text_config``); the file's
classes are the text model's.

Emits: those classes reading ``hf_text_config`` (vLLM's text part of the checkpoint's config;
the config itself for a text-only checkpoint), and the checkpoint's architecture as a
subclass of the causal LM whose ``load_weights`` renames the checkpoint's text tensors to the
causal LM's names and skips the rest, and whose ``__init__`` renames the names a quantized
checkpoint's config gives its unquantized modules the same way. Where the multimodal config's own
``tie_word_embeddings`` ties the lm_head (Gemma-3's), the file reads that one::

    class Llama4ForConditionalGeneration(Llama4ForCausalLM):
        text_model_names = WeightsMapper(orig_to_new_prefix={
            "language_model.model.": "model.", "vision_model.": None, ...})

        def load_weights(self, weights):
            renamed = ((self.text_model_names.map_name(n), t) for n, t in weights)
            return super().load_weights((n, t) for n, t in renamed if n is not None)

Preconditions: the analysis found where the multimodal class keeps the text model, in
memory and as ``save_pretrained`` writes it (analyze/composite.py).
"""

from __future__ import annotations

import json

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites

NAME = "composite_text"
_HF_CONFIG = m.Attribute(
    value=m.Attribute(value=m.Name("vllm_config"), attr=m.Name("model_config")), attr=m.Name("hf_config")
)


class _TextConfig(cst.CSTTransformer):
    """``vllm_config.model_config.hf_config`` -> ``...hf_text_config``."""

    def __init__(self) -> None:
        self.count = 0

    def leave_Attribute(self, original, updated):
        if m.matches(updated, _HF_CONFIG):
            self.count += 1
            return updated.with_changes(attr=cst.Name("hf_text_config"))
        return updated


class _CompositeTie(cst.CSTTransformer):
    """``config.tie_word_embeddings`` -> the checkpoint config's (``hf_config``): the flag
    that ties the multimodal model's lm_head (a text-only checkpoint's config is both)."""

    def leave_Attribute(self, original, updated):
        if m.matches(updated, m.Attribute(value=m.Name("config"), attr=m.Name("tie_word_embeddings"))):
            return updated.with_changes(value=t.expr("vllm_config.model_config.hf_config"))
        return updated


def _subclass(architecture: str, text_lm: str, prefixes) -> cst.ClassDef:
    entries = "".join(
        f"            {json.dumps(old)}: {'None' if new is None else json.dumps(new)},\n"
        for old, new in prefixes
    )
    return t.stmt(
        f"class {architecture}({text_lm}):\n"
        f'    """{architecture} checkpoints, their text model alone: the other parts are not loaded and no image is taken."""\n\n'
        "    # the checkpoint's names of the text model -> this model's; None: not loaded\n"
        "    text_model_names = WeightsMapper(\n"
        "        orig_to_new_prefix={\n"
        f"{entries}"
        "        }\n"
        "    )\n\n"
        '    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:\n'
        "        # a quantized checkpoint's config names the modules it left unquantized as the\n"
        "        # checkpoint does: renamed to this model's, or they would be built quantized\n"
        "        if vllm_config.quant_config is not None:\n"
        "            vllm_config.quant_config.apply_vllm_mapper(self.text_model_names.get_rename_mapper())\n"
        "        super().__init__(vllm_config=vllm_config, prefix=prefix)\n\n"
        "    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:\n"
        "        renamed = ((self.text_model_names.map_name(name), tensor) for name, tensor in weights)\n"
        "        return super().load_weights((name, tensor) for name, tensor in renamed if name is not None)\n"
    )


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    composite = ctx.plan.composite
    if composite is None:
        return PassResult(module=module)
    text_config = _TextConfig()
    module = module.visit(text_config)
    text_lm = ctx.plan.architecture
    tied = []
    if composite.tie_from_composite:  # the base model (its embedding on the last rank) and the causal LM
        for name in (ctx.plan.base_model_class, text_lm):
            module = Sites().replace_class(module, name, t.find_class(module, name).visit(_CompositeTie()))
        tied = [
            FusionRow(
                text_lm,
                "lm_head tied by the checkpoint config's tie_word_embeddings, as transformers ties it",
            )
        ]
    at = next(i for i, n in enumerate(module.body) if isinstance(n, cst.ClassDef) and n.name.value == text_lm)
    subclass = _subclass(composite.architecture, text_lm, composite.prefixes)
    module = module.with_changes(body=[*module.body[: at + 1], subclass, *module.body[at + 1 :]])
    rows = (
        FusionRow(
            text_lm, f"vllm_config.model_config.hf_config -> hf_text_config ({text_config.count} sites)"
        ),
        FusionRow(
            composite.architecture,
            f"subclass of {text_lm} loading the checkpoint's text model alone "
            f"({sum(new is not None for _, new in composite.prefixes)} prefixes renamed, "
            f"{sum(new is None for _, new in composite.prefixes)} skipped)",
        ),
        *tied,
    )
    return PassResult(module=module, imports=("WeightsMapper", "Iterable"), fused=rows, matches=1)
