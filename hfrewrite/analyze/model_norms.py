"""The one vLLM norm a model's norms compute: the decoder layer's, its attention's own
(q/k, or MLA's latent norms) and the final norm must all be the same vLLM norm, built from
the same config fields (analyze/norm.py). Otherwise the source's norms are kept and a fused
decoder layer is carried instead (declined facts).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from hfrewrite.analyze.leaf_modules import is_norm
from hfrewrite.analyze.norm import analyze_norm, config_fields
from hfrewrite.analyze.plan import AttentionPlan, DecoderLayerPlan, MlaPlan, NoMatch, NormPlan


@dataclass(frozen=True)
class NormFacts:
    """The one vLLM norm of the model, the decoder plan fitted to it, and what was declined."""

    norm: NormPlan | None  # None: the source's norms are kept
    decoder: DecoderLayerPlan
    declined: tuple[NoMatch, ...]


def norm_modules(
    layer: nn.Module,
    decoder: DecoderLayerPlan,
    attention: AttentionPlan | MlaPlan | None,
    final_norm: nn.Module | None,
) -> list[nn.Module]:
    """The norms one vLLM norm class must compute: the layer's own, its attention's (q/k, or
    MLA's latent norms) where they are of a class the layer's norms are, and the base model's
    final norm. The pass renames that class alone: q/k norms of another class (Llama-4's
    weightless L2 norm) stay the source's."""
    modules = [m for _, m in layer.named_children() if is_norm(m)]
    layer_classes = {type(m) for m in modules}
    own_norms = (
        (attention.q_a_norm, attention.kv_a_norm)
        if isinstance(attention, MlaPlan)
        else (attention.q_norm, attention.k_norm)
        if attention is not None
        else ()  # an attention-free model's
    )
    attention_module = layer.get_submodule(decoder.attention_block)
    for attr in own_norms:  # (a branch proven on a sibling config may have none here)
        own = getattr(attention_module, attr or "", None)
        if isinstance(own, nn.Module) and (type(own) in layer_classes or not layer_classes):
            modules.append(own)
    return [*modules, final_norm] if final_norm is not None else modules


def norm_facts(modules: list[nn.Module], small, decoder: DecoderLayerPlan) -> NormFacts:
    """The vLLM norm of ``modules`` (``small``: the traced config); without one, the source's
    norms are kept and a fused ``decoder`` is carried instead."""
    norm, why = _one_norm(modules, small)
    if norm is not None:
        return NormFacts(norm, decoder, ())
    declined = (
        NoMatch(
            "rms_norm",
            type(modules[0]).__name__,
            f"{why}; the source's norms are kept",
        ),
    )
    if decoder.fused:  # vLLM's fused residual norms need vLLM norms
        decoder = dataclasses.replace(decoder, blocks=())
        declined += (
            NoMatch(
                "fused_residual_norm",
                decoder.module_class,
                "the norms are the source's; the layer's forward is carried from the source",
            ),
        )
    return NormFacts(None, decoder, declined)


def _one_norm(modules: list[nn.Module], small) -> tuple[NormPlan | None, str]:
    """The one vLLM norm all ``modules`` compute, or None and why not."""
    norms = [analyze_norm(m) for m in modules]
    failed = [n for n in norms if isinstance(n, NoMatch)]
    if failed:
        return None, failed[0].reason
    if len(set(norms)) != 1:
        return None, f"norms differ: {sorted({str(n) for n in norms})}"
    fields = {config_fields(m, norms[0].eps, small) for m in modules}
    if len(fields) != 1 or isinstance(next(iter(fields)), str):
        return None, next(
            (f for f in fields if isinstance(f, str)), "norms built from different config fields"
        )
    return dataclasses.replace(norms[0], config_fields=next(iter(fields))), ""
