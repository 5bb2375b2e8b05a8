"""Decoder layers of two classes: a hybrid whose layers of its other mixer are a class of
their own beside its attention layers' (Jamba's ``JambaMambaDecoderLayer`` beside
``JambaAttentionDecoderLayer``, OLMo-hybrid's gated-delta-net layers beside its post-norm
attention layers, chosen per layer by the base model). The file keeps both classes; each is
rewritten with its own decoder plan, the layers of each class agreeing with one another
(compare_layers), both fused into vLLM's residual norms or both carried. Any other split of
classes refuses."""

from __future__ import annotations

import dataclasses

from torch import nn

from hfrewrite.analyze.model_norms import NormFacts, norm_facts, norm_modules
from hfrewrite.analyze.plan import DecoderLayerPlan, NoMatch, Refusal, refuse

SEVERAL = "decoder layers of several classes"


def mixer_layer(per_layer: list, lead: DecoderLayerPlan) -> DecoderLayerPlan | None:
    """The decoder plan of the mixer's layers where they are a class other than the attention
    layers' ``lead`` (None where every layer is one class); else a refusal saying which split
    of classes hfrewrite does not follow."""
    classes = {facts.decoder.module_class for facts in per_layer}
    if len(classes) == 1:
        return None
    attending = {facts.decoder.module_class for facts in per_layer if facts.attention is not None}
    mixing = [facts for facts in per_layer if facts.attention is None and facts.mixer is not None]
    others = [facts for facts in per_layer if facts.attention is None and facts.mixer is None]
    plans = {facts.decoder for facts in mixing}
    if attending != {lead.module_class} or others or len(plans) != 1:
        refuse(
            "model_layout",
            f"{SEVERAL} ({', '.join(sorted(classes))}): hfrewrite follows one class for the attention "
            "layers and one for a hybrid's other mixer",
            lead.module_class,
        )
    decoder = plans.pop()  # (of the other class: the attention layers are all of lead's)
    if any(facts.mixer is not None for facts in per_layer if facts.attention is not None):
        refuse("model_layout", f"{SEVERAL}, the mixer's in the attention layers' too", lead.module_class)
    if lead.fused and not decoder.fused:
        refuse(
            "model_layout",
            f"{SEVERAL}, the attention layers' forward fused and the mixer layers' carried",
            decoder.module_class,
        )
    # attention layers carried from the source (OLMo-hybrid's post-norms): the mixer's
    # layers are carried too, each returning its hidden states alone as the model expects
    return decoder if lead.fused else dataclasses.replace(decoder, blocks=())


def carried_with_attention(per_layer: list, own_class: DecoderLayerPlan | None) -> tuple[NoMatch, ...]:
    """--explain's row for the mixer's own class carried although its forward would fuse:
    the attention layers' class is carried (OLMo-hybrid's post-norms)."""
    if own_class is None or own_class.fused:
        return ()
    traced = next(f.decoder for f in per_layer if f.decoder.module_class == own_class.module_class)
    if not traced.fused:
        return ()
    why = (
        "its forward would fuse, and is carried from the source as the attention layers' class "
        "is: every layer returns its hidden states alone"
    )
    return (NoMatch("fused_residual_norm", own_class.module_class, why),)


def unrun_classes(layers: list[nn.Module], failed: Refusal) -> Refusal:
    """``failed`` (the shrunk model's example run), saying so where the layers are of several
    classes: the run fails before the analysis can tell whether it follows them (Zamba2's)."""
    classes = sorted({type(layer).__name__ for layer in layers})
    if len(classes) == 1:
        return failed
    no_match = failed.no_match
    why = (
        f"{no_match.reason} (the shrunk model's decoder layers are of several classes: {', '.join(classes)})"
    )
    return Refusal(NoMatch(no_match.pattern, no_match.module_class, why))


def layer_norms(traces, per_layer, lead, decoder, attention, final, own_class, small) -> NormFacts:
    """The norms' facts (model_norms.py) over the lead layer's norms, the final norm and, for
    the mixer's layers of a class of their own, theirs: one vLLM norm or the source's."""
    modules = norm_modules(traces[lead].module, decoder, attention, final)
    if own_class is not None:
        at = next(
            i for i, facts in enumerate(per_layer) if facts.decoder.module_class == own_class.module_class
        )
        modules += norm_modules(traces[at].module, own_class, None, None)
    norms = norm_facts(modules, small, decoder)
    if own_class is not None and norms.norm is None:
        refuse("model_layout", f"{SEVERAL} whose norms are not one vLLM norm", own_class.module_class)
    return norms


def one_per_class(layers: list[nn.Module]) -> list[nn.Module]:
    """The first layer of each class, in order: a switch of each class's code is read."""
    return list({type(layer): layer for layer in reversed(layers)}.values())[::-1]
