"""What the traced decoder layers of one model must agree on, and the facts to emit from
them: one layer shape, one MLP or MoE kind, one rope where rope is applied (NoPE layers
aside), sliding windows that may differ per layer. A hybrid model's layers of another mixer
(LFM2's short convolutions) agree with its attention layers on everything but the mixer,
and among themselves on that."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hfrewrite.analyze.attention_calls import AttentionCall
from hfrewrite.analyze.norm_kinds import QkNormOrder
from hfrewrite.analyze.plan import (
    AttentionPlan,
    DecoderLayerPlan,
    KeptMlp,
    MixerPlan,
    MlaPlan,
    MlpPlan,
    MoePlan,
    NoMatch,
    refuse,
)
from hfrewrite.analyze.rope_styles import RopeLayers, RopeStyle, RopeTurn


@dataclass(frozen=True)
class LayerFacts:
    """What one traced decoder layer proves: its MLP block is either a dense gated MLP or
    a sparse MoE block (whose shared expert, if any, is a dense MLP too)."""

    decoder: DecoderLayerPlan
    attention: AttentionPlan | MlaPlan | None  # None: a hybrid model's layer of another mixer
    mlp: MlpPlan | None  # the dense MLP, or the MoE block's shared expert
    moe: MoePlan | None
    declined: NoMatch | None  # the layer's shape vLLM's fused norms do not fit: its forward is carried
    mixer: MixerPlan | None = None  # that other mixer (its block is decoder.attention_block)
    mlp_kept: tuple[NoMatch, KeptMlp] | None = None  # a dense MLP no form fits (carried_mlp.py)


def one_kind(plans: list, kind: type):
    """The plan of one kind all layers share (sizes aside), or None when no layer has one."""
    found = [p for p in plans if p is not None]
    if not found:
        return None
    shapes = {_without_sizes(p) for p in found}
    if len(shapes) != 1:
        refuse(
            "uniform_layers",
            f"layers differ in their {kind.__name__}",
            found[0].module_class,
        )
    return found[0]


def _without_sizes(plan):
    if isinstance(plan, MlpPlan):
        gate = plan.gate and (plan.gate.attr, plan.gate.bias)
        return (
            plan.module_class,
            gate,
            plan.up.attr,
            plan.down.attr,
            plan.up.bias,
            plan.act_attr,
            plan.form,
        )
    return plan


def kept_mlps(per_layer: list[LayerFacts]) -> tuple[tuple[NoMatch, ...], tuple[KeptMlp, ...]]:
    """The dense MLP classes kept from the source, once each (their declined facts, and
    the Linears each calls); a class that some layer's rewrite fits and another's does not
    refuses (one class, one emitted body)."""
    kept: dict[KeptMlp, NoMatch] = {}
    for facts in per_layer:
        if facts.mlp_kept is not None:
            kept.setdefault(facts.mlp_kept[1], facts.mlp_kept[0])
    rewritten = {facts.mlp.module_class for facts in per_layer if facts.mlp is not None}
    classes = [mlp.module_class for mlp in kept]
    for name in classes:
        if name in rewritten:
            refuse("uniform_layers", "the MLP's rewrite fits some layers and not others", name)
        if classes.count(name) > 1:
            refuse("uniform_layers", "layers call different Linears of one kept MLP class", name)
    return tuple(kept.values()), tuple(kept)


def compare_layers(per_layer: list[LayerFacts]) -> tuple[NoMatch, ...]:
    """Layers must agree (dense and MoE MLP blocks may mix); a differing sliding
    window is kept as a declined fact."""
    free = attention_free(per_layer)
    first = per_layer[0] if free else attention_layers(per_layer)[0]
    # the mixer's layers of a class of their own agree with the first of that class
    # (analyze/layer_classes.py: each class has its own decoder plan)
    own = {f.decoder.module_class: f for f in reversed(per_layer) if f.mixer is not None}
    for i, facts in enumerate(per_layer):
        if facts.mixer is not None:  # its mixer sits where the attention layers have theirs
            lead = (
                first
                if facts.decoder.module_class == first.decoder.module_class
                else own[facts.decoder.module_class]
            )
            pairs = [(_but_the_mixer(facts.decoder), _but_the_mixer(lead.decoder))]
        elif facts.attention is None:  # a layer whose one block is an MLP (block_kinds.py)
            pairs = [(facts.decoder, first.decoder)]
        else:
            pairs = [
                (facts.decoder, first.decoder),
                (_no_window(facts.attention), _no_window(first.attention)),
            ]
        if differing := next(((a, b) for a, b in pairs if a != b), None):
            refuse("uniform_layers", f"layer {i} differs{_in_fields(*differing)}", facts.decoder.module_class)
    if free:
        return ()
    windows = [getattr(facts.attention, "sliding_window", None) for facts in attention_layers(per_layer)]
    if len(set(windows)) == 1:
        return ()
    reason = f"layers differ in sliding_window {windows}; the source's per-layer expression is carried"
    return (NoMatch("uniform_sliding_window", first.attention.module_class, reason),)


def _in_fields(theirs, ours) -> str:
    """`` in <the fields two plans of one kind differ in>``, or "" where they are not."""
    if type(theirs) is not type(ours) or not dataclasses.is_dataclass(ours):
        return ""
    fields = [f.name for f in dataclasses.fields(ours) if getattr(theirs, f.name) != getattr(ours, f.name)]
    return f" in {', '.join(fields)}" if fields else ""


def _no_window(attention: AttentionPlan) -> AttentionPlan:
    """The facts layers must share: sliding windows and sinks may differ, and rope may be absent
    on some layers (NoPE: cohere2's global layers), never different where present; so may
    the scale of a call through transformers' interface, whose ``scaling=`` expression the
    file carries (GPT-2's ``scale_attn_by_inverse_layer_idx``: each layer's own); so may the
    head counts and the projections' sizes (OpenELM's layer-wise scaling), where the file
    sizes each layer by the source's own expressions (emitted_attention.py), and so may the
    sizes of an output gate's projection."""
    if isinstance(attention, MlaPlan):
        return attention
    carried = attention.attention_call is AttentionCall.INTERFACE
    return dataclasses.replace(
        attention,
        **{
            role: dataclasses.replace(getattr(attention, role), in_features=0, out_features=0)
            for role in "qkvo"
        },
        num_heads=0,
        num_kv_heads=0,
        scaling=None if carried else attention.scaling,
        sliding_window=None,
        attention_chunk=None,
        rope_layers=RopeLayers.NONE,
        rope_style=RopeStyle.NEOX,
        rotary_dim=None,
        rope_turn=RopeTurn.FORWARD,
        rope_base_field=None,
        replaced_calls=(),
        **_NO_NORMS,
        q_position_scale=None,
        sinks=None,
        returned_parameters=(),
        output_gate=_unsized(attention.output_gate),
    )


def _unsized(gate):
    """An output gate without its sizes: its Linear is built from the source's expressions too
    (Laguna-XS.2's one gate per head, 48 or 64 heads by layer)."""
    return None if gate is None else dataclasses.replace(gate, in_features=0, out_features=0)


# q/k norms may be absent on some layers (Llama-4's NoPE layers): their file keeps the
# source's test on them (emit/after_split.py), or refuses
_NO_NORMS = {"q_norm": None, "k_norm": None, "qk_norm_over": None, "qk_norm_order": QkNormOrder.BEFORE_ROPE}


def _norms(plan: AttentionPlan) -> tuple:
    return tuple(getattr(plan, name) for name in _NO_NORMS)


def rope_layers(per_layer: list[LayerFacts]) -> AttentionPlan:
    """The attention facts to emit: a layer with rope (all roped layers agree on it),
    marked when other layers have none."""
    plans = [facts.attention for facts in attention_layers(per_layer)]
    if isinstance(plans[0], MlaPlan):
        return plans[0]
    roped = [a for a in plans if a.rope_layers is not RopeLayers.NONE]
    # rope parameters per layer type (Laguna-XS.2's partial YaRN on full layers, whole-head
    # default rope on sliding ones): each layer's width was proven against its own type's
    # parameters, which the file hands get_rope, so the widths may differ
    per_type = _widths_per_type(roped)
    kinds = {
        (a.rope_style, None if per_type else a.rotary_dim, a.rope_turn, a.rope_base_field, a.replaced_calls)
        for a in roped
    }
    if len(kinds) > 1:
        refuse("uniform_layers", "layers differ in their rope", plans[0].module_class)
    normed = {_norms(a) for a in plans if a.q_norm or a.k_norm}
    if len(normed) > 1:
        refuse("uniform_layers", "layers differ in their q/k norms", plans[0].module_class)
    # sinks on some layers only (MiMo-V2-Flash's sliding ones): the file builds the source's
    # parameter as its __init__ does, None where the call passed none
    sinks = {a.sinks for a in plans if a.sinks}
    if len(sinks) > 1:
        refuse("uniform_layers", "layers pass different attention sinks", plans[0].module_class)
    # parameters returned beside the output on some layers only (GPT-NeoX-Japanese's last
    # layer's dense_bias; None elsewhere): the carried layer reads the attribute, as the source's
    returned = {a.returned_parameters for a in plans if a.returned_parameters}
    if len(returned) > 1:
        refuse(
            "uniform_layers", "layers return different parameters beside their output", plans[0].module_class
        )
    chosen = min(roped, key=lambda a: a.rotary_dim or a.head_dim) if roped else plans[0]  # (partial first)
    norms = dict(zip(_NO_NORMS, normed.pop())) if normed else {}
    return dataclasses.replace(
        chosen,
        sliding_window=plans[0].sliding_window,
        rope_layers=RopeLayers.SOME if roped and len(roped) != len(plans) else chosen.rope_layers,
        **norms,
        qk_norm_layers_some=bool(norms) and any(not (a.q_norm or a.k_norm) for a in plans),
        q_position_scale=_q_scale(plans),
        sinks=sinks.pop() if sinks else None,
        returned_parameters=returned.pop() if returned else (),
    )


def _widths_per_type(roped: list[AttentionPlan]) -> bool:
    """Each layer's rope parameters are its layer type's, and its width is theirs: none read a
    width of lanes from a config field of its own (GPT-J's rotary_dim)."""
    return bool(roped) and all(a.rope_per_layer_type and not a.rotary_dim_field for a in roped)


def _q_scale(plans: list[AttentionPlan]) -> tuple[str, ...] | None:
    """The layers' one per-token q scale by position; only one the file computes under the
    source's own test (where the forward makes its positions) may be absent on some."""
    scales = {a.q_position_scale for a in plans}
    found = scales - {None}
    made = len(next(iter(found), ())) == 3  # (line, expression, positions' local)
    if len(found) > 1 or (found and None in scales and not made):
        refuse("uniform_layers", "layers differ in their q scale by position", plans[0].module_class)
    return next(iter(found), None)


def attention_free(per_layer: list[LayerFacts]) -> bool:
    """No layer attends and every one holds a proven mixer (a Mamba-2 model): vLLM's
    attention-free contract."""
    return all(facts.attention is None and facts.mixer is not None for facts in per_layer)


def attention_layers(per_layer: list[LayerFacts]) -> list[LayerFacts]:
    """The layers with attention; a model whose layers all mix otherwise refuses."""
    found = [facts for facts in per_layer if facts.attention is not None]
    if not found:
        refuse(
            "decoder_layer",
            "no layer computes attention: hfrewrite converts a hybrid's other mixers beside attention "
            "layers, and this config has none (convert a config whose layers include attention)",
            per_layer[0].decoder.module_class,
        )
    return found


def mixer_plan(per_layer: list[LayerFacts]) -> MixerPlan | None:
    """The one other mixer of a hybrid model's layers, if any."""
    mixers = [facts.mixer for facts in per_layer]
    return one_kind(mixers, type(next((m for m in mixers if m is not None), None)))


def _but_the_mixer(decoder: DecoderLayerPlan) -> DecoderLayerPlan:
    """``decoder`` less what names or returns its first block's mixer, and its class (a
    class of its own for the mixer's layers: analyze/layer_classes.py)."""
    mixer = decoder.attention_block
    blocks = tuple(dataclasses.replace(b, block="") if b.block == mixer else b for b in decoder.blocks)
    return dataclasses.replace(
        decoder,
        module_class="",
        blocks=blocks,
        attention_block="",
        attention_returns_tuple=False,
        attention_returns_list=False,
    )
