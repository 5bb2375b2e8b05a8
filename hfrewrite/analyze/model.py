"""The analysis entry point: config -> ModelPlan (frozen facts) or one clear error.

Steps: shrink the config (:func:`shrink_config`); build its ``AutoModelForCausalLM`` on
CPU with the opaque attention of :mod:`hfrewrite.analyze.trace`; find the embedding, decoder
ModuleList, final norm and lm_head in the module tree; run the model once on example
ids to capture what each decoder layer receives; trace each layer of the shrunk model
(one per distinct ``layer_types`` entry, at least two) whole, attention and MLP inline;
run the pattern analyses on each trace and check that the layers agree.

A required pattern that does not match raises ``HfrewriteError`` naming the model type,
module class, pattern and reason. A difference between layers that the emitted code
absorbs (the sliding window, which the source computes per layer) is kept in
``ModelPlan.declined``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import transformers
from torch import nn

from hfrewrite.analyze.block_kinds import block_attention, lead_layer, one_block_facts
from hfrewrite.analyze.block_output import hidden_output
from hfrewrite.analyze.branches import forward_switches, forward_switches_of_layers, init_switches
from hfrewrite.analyze.carried_mlp import carry_mlp
from hfrewrite.analyze.causal_mask import windowed
from hfrewrite.analyze.checkpoint import (
    checkpoint_prefix_renames,
    checkpoint_renames,
    checkpoint_roots,
    expert_checkpoint_names,
    unexpected_prefixes,
    unexpected_suffixes,
)
from hfrewrite.analyze.decoder import analyze_decoder, carried_layer
from hfrewrite.analyze.emitted_attention import emitted_attention
from hfrewrite.analyze.example_run import ExampleRun, build_model, error_line, example_run, initialise_empty
from hfrewrite.analyze.flat_layout import flat_plan
from hfrewrite.analyze.layer_agreement import (
    LayerFacts,
    attention_layers,
    compare_layers,
    kept_mlps,
    mixer_plan,
    one_kind,
)
from hfrewrite.analyze.layer_classes import (
    carried_with_attention,
    layer_norms,
    mixer_layer,
    one_per_class,
    unrun_classes,
)
from hfrewrite.analyze.layer_defaults import free_defaults
from hfrewrite.analyze.linear_classes import prove_linear_classes
from hfrewrite.analyze.lm_head import EMBEDDING, head_kind
from hfrewrite.analyze.logit_softcap import softcap_field
from hfrewrite.analyze.manual_attention import fold_manual_attention
from hfrewrite.analyze.mixers import layer_mixer, layers_mixer, proven_mixer
from hfrewrite.analyze.mla_variants import with_other_branches
from hfrewrite.analyze.mlp import analyze_inline_mlp, analyze_mlp
from hfrewrite.analyze.model_layout import ModelLayout, embedding_subclass, flattened, model_layout
from hfrewrite.analyze.moe import analyze_moe
from hfrewrite.analyze.moe_variants import with_other_routings
from hfrewrite.analyze.plan import (
    AttentionPlan,
    DecoderLayerPlan,
    KeptMlp,
    MixerPlan,
    MlaPlan,
    MlpPlan,
    ModelPlan,
    MoePlan,
    NoMatch,
    NormPlan,
    Refusal,
    refuse,
)
from hfrewrite.analyze.qk_norm_variants import with_qk_norm_branch
from hfrewrite.analyze.qkv_width import prove_at_more_heads
from hfrewrite.analyze.rope_constants import prove_rope_constants
from hfrewrite.analyze.shrink import HEADS, shrink_config
from hfrewrite.analyze.slice_writes import fold_slice_writes
from hfrewrite.analyze.tied_head import flipped_tie, head_sibling, tied_target
from hfrewrite.analyze.trace import Traced, trace, value
from hfrewrite.analyze.transposed_linears import swap_transposed_linears
from hfrewrite.analyze.vllm_sizes import vllm_sizes
from hfrewrite.errors import CannotBuild, HfrewriteError


def analyze(config: transformers.PretrainedConfig) -> ModelPlan:
    """Trace a shrunk copy of ``config``'s model; its plan, or ``HfrewriteError``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add contention (5x slower)
    try:
        return _analyze(config)
    except Refusal as refused:
        message = f"{config.model_type}: {refused.no_match}"
        no_match = refused.no_match
        unbuildable = no_match.pattern == "example run" or no_match.reason.startswith("cannot build")
        raise (CannotBuild if unbuildable else HfrewriteError)(message) from refused.__cause__
    finally:
        torch.set_num_threads(threads)


def _analyze(
    config: transformers.PretrainedConfig,
    branches: bool = True,
    heads: int = HEADS,
    edits: dict | None = None,
) -> ModelPlan:
    """The plan of ``config`` shrunk to ``heads`` query heads; with ``branches``, the other
    branches of MLA's query and rope and of a router's string switch proven on sibling
    configs (analyze/mla_variants.py, analyze/moe_variants.py), and a reordered q/k/v
    layout at a second head count (analyze/qkv_width.py); ``edits``: fields set on the shrunk
    config (analyze/rope_constants.py)."""
    small = _shrunk(config, heads)
    for field, edited in (edits or {}).items():
        setattr(small, field, edited)
    torch.manual_seed(0)
    model = build_model(small)
    model.eval()
    initialise_empty(model)
    transposed_classes, transposed = swap_transposed_linears(model)  # Conv1D -> nn.Linear
    linear_classes = prove_linear_classes(model)  # before any trace: its linear leaves
    layout = model_layout(model, config, small)
    try:
        run = example_run(model, layout)
    except Refusal as failed:
        raise unrun_classes(layout.layers, failed) from failed.__cause__
    flipped = flipped_tie(small, build_model)
    if flipped is not None:
        initialise_empty(flipped)
    flipped_head = (
        flipped.get_submodule(layout.head) if flipped is not None and not layout.head_weight else None
    )
    if layout.head_weight:  # no head module: the embedding's weight, proven in example_run
        kind = EMBEDDING
    else:
        kind = head_kind(
            model.get_submodule(layout.head), run.head_input, run.head_output, small, flipped_head
        )
    source = _SourceModel(
        config=config,
        small=small,
        model=model,
        layout=layout,
        run=run,
        head_kind=kind,
        flipped=flipped,
        linear_classes=linear_classes,
        transposed_classes=transposed_classes,
        transposed=transposed,
    )
    return flat_plan(_model_plan(source, _layer_plans(source, branches)), layout, small)


@dataclass(frozen=True)
class _SourceModel:
    """The shrunk source model, built, laid out and run once on example ids."""

    config: transformers.PretrainedConfig
    small: transformers.PretrainedConfig  # the shrunk config it is built from
    model: nn.Module
    layout: ModelLayout
    run: ExampleRun
    head_kind: str  # lm_head.py's layout of the head's weight
    flipped: nn.Module | None  # built with tie_word_embeddings flipped (tied_head.py)
    linear_classes: tuple[str, ...]  # nn.Linear subclasses proven to compute F.linear
    transposed_classes: tuple[str, ...]  # Conv1D-like classes swapped for nn.Linear
    transposed: tuple[str, ...]  # the swapped modules' paths below the layer index


@dataclass(frozen=True)
class _LayerPlans:
    """What the traced decoder layers agree on, with what was declined and the sibling
    configs proven (description, config)."""

    decoder: DecoderLayerPlan
    attention: AttentionPlan | MlaPlan
    mlp: MlpPlan | None
    moe: MoePlan | None
    norm: NormPlan | None  # None: the source's norms are kept
    declined: tuple[NoMatch, ...]
    siblings: tuple[tuple[str, object], ...]
    mixer: MixerPlan | None  # a hybrid model's other mixer
    kept_mlps: tuple[KeptMlp, ...]  # feed-forward classes kept from the source
    head_counts: tuple[tuple[int, int], ...] = ()  # each attention layer's (heads, kv heads)
    mixer_layer: DecoderLayerPlan | None = None  # the mixer's layers' class, when not the decoder's


def _shrunk(config: transformers.PretrainedConfig, heads: int) -> transformers.PretrainedConfig:
    """``config`` shrunk for tracing (:func:`shrink_config`); a composite config refuses."""
    try:
        small = shrink_config(config, heads)
    except Exception as exc:  # noqa: BLE001 - the config class refuses an edit: a true reason
        refuse("config", f"cannot build a shrunk config: {error_line(exc)}", type(config).__name__)
    if getattr(small, "vocab_size", None) is None:
        nested = [k for k, v in vars(small).items() if isinstance(v, transformers.PretrainedConfig)]
        refuse(
            "model_layout",
            "the config has no vocab_size: a composite config"
            + (f" (its parts: {', '.join(nested)})" if nested else ""),
            type(config).__name__,
        )
    return small


def _attention_branches(config, small, attention, module):
    """The attention plan proven further on sibling configs (other head counts, rope constants,
    the q/k norms or MLA branches the traced config leaves off); what could not be proven;
    the sibling configs proven (validated at convert time too)."""
    prove_at_more_heads(attention, lambda heads: _analyze(config, False, heads).attention.qkv_layout)
    attention = prove_rope_constants(attention, small, lambda e: _analyze(config, False, edits=e).attention)

    def sibling_attention(other):
        return _analyze(other, branches=False).attention

    if isinstance(attention, AttentionPlan):
        return with_qk_norm_branch(config, attention, module, sibling_attention)
    if isinstance(attention, MlaPlan):
        return with_other_branches(config, attention, sibling_attention)
    return attention, (), ()


def _layer_plans(source: _SourceModel, branches: bool) -> _LayerPlans:
    """Trace each decoder layer and analyse it; the plans all layers share (see _analyze for
    ``branches``)."""
    config, small, layout, run = source.config, source.small, source.layout, source.run
    masks = not windowed(small)  # a causal mask the base model hands its layers is proven by value
    traces = [
        _trace_layer(layer, args, kwargs, masks)
        for layer, (args, kwargs) in zip(layout.layers, run.layer_inputs)
    ]
    types = getattr(small, "layer_types", None) or [None] * len(traces)
    per_layer = [
        _layer_facts(t, config, small, layer_type, i) for i, (t, layer_type) in enumerate(zip(traces, types))
    ]
    free, lead, decoder = lead_layer(per_layer, layout.layers)
    declined = compare_layers(per_layer)
    attention = None if free else emitted_attention(per_layer, traces, lead, small)
    siblings = head_sibling(config, source.head_kind)
    if branches and not free:
        attention_module = traces[lead].module.get_submodule(decoder.attention_block)
        attention, more, branch_configs = _attention_branches(config, small, attention, attention_module)
        declined += more
        siblings += branch_configs
    mlp, moe = (
        one_kind([f.mlp for f in per_layer], MlpPlan),
        one_kind([f.moe for f in per_layer], MoePlan),
    )
    if mlp is not None and decoder.mlp_block:  # OpenELM's `if config.ffn_with_glu:` builds it
        block = traces[lead].module.get_submodule(decoder.mlp_block)
        if type(block).__name__ == mlp.module_class:
            mlp = dataclasses.replace(mlp, init_switches=init_switches(block, small))
    if branches and moe is not None:
        moe, more, routings = _with_routings(config, moe, source.model)
        declined += more
        siblings += routings

    final = layout.base.get_submodule(run.final_norm) if run.final_norm else None
    own_class = mixer_layer(per_layer, decoder)  # the mixer's layers, a class of their own (Jamba)
    declined += carried_with_attention(per_layer, own_class)
    norms = layer_norms(traces, per_layer, lead, decoder, attention, final, own_class, small)
    decoder, declined = norms.decoder, declined + norms.declined
    if per_layer[lead].declined is not None:  # the layer shape itself was not fusable
        declined += (per_layer[lead].declined,)
    kept_declined, kept = kept_mlps(per_layer)
    declined += kept_declined
    if not decoder.fused and (hidden := hidden_output(traces[lead])) is not None:
        args, kwargs = run.layer_inputs[lead]  # the carried forward's inputs vLLM leaves at their defaults
        decoder = dataclasses.replace(
            decoder, free_defaults=free_defaults(layout.layers[lead], args, kwargs, value(hidden))
        )
    mixer = layers_mixer(mixer_plan(per_layer), per_layer, layout.layers, lead, types)
    counts = tuple(
        (f.attention.num_heads, f.attention.num_kv_heads)
        for f in ([] if free else attention_layers(per_layer))
        if isinstance(f.attention, AttentionPlan)
    )
    return _LayerPlans(
        decoder, attention, mlp, moe, norms.norm, declined, siblings, mixer, kept, counts, own_class
    )


def _with_routings(config, moe: MoePlan, model: nn.Module) -> tuple[MoePlan, tuple, tuple]:
    """``moe`` extended by its router's other routings (moe_variants.py), what could not be
    proven, and the sibling configs proven."""
    router = next((m for m in model.modules() if type(m).__name__ == moe.router_class), None)
    if router is None:
        return moe, (), ()
    return with_other_routings(config, moe, router, lambda other: _analyze(other, branches=False).moe)


def _sizes_for_vllm(source: _SourceModel, plans: _LayerPlans) -> tuple[tuple[str, str], ...]:
    """What vLLM reads that a repository's own configuration holds otherwise (vllm_sizes.py)."""
    if not (plans.head_counts and getattr(source.small, "auto_map", None)):
        return ()
    layout, run = source.layout, source.run
    return vllm_sizes(
        source.config,
        source.small,
        layout.base,
        layout.layers_attr,
        run.embed,
        plans.attention,
        plans.head_counts,
    )


def _head_tied_to(source: _SourceModel) -> str | None:
    """The embedding the head's weight is when tied (tied_head.py), or whose weight the
    logits are computed with (functional_head.py)."""
    tied = source.model if getattr(source.small, "tie_word_embeddings", False) else source.flipped
    return flattened(source.layout.head_weight or tied_target(tied, source.layout.head), source.layout)


def _model_plan(source: _SourceModel, plans: _LayerPlans) -> ModelPlan:
    """The model's plan: its layout, example run and head facts, and its layers' plans."""
    config, small, model, run = source.config, source.small, source.model, source.run
    base, head, layers = source.layout.base, source.layout.head, source.layout.layers
    soft_cap = softcap_field(model, head) if run.logits_postprocessed else None
    prefixes = checkpoint_prefix_renames(config.model_type) + checkpoint_prefix_renames(type(model).__name__)
    return ModelPlan(
        model_type=config.model_type,
        # the causal-LM class the source defines; a config may name another architecture
        # (vllm_tree / plugin register the config's names onto this class)
        architecture=type(model).__name__,
        config_class=type(model.config).__name__,
        base_model_class=type(base).__name__,
        base_model_attr=source.layout.base_attr,
        embed_tokens=run.embed,
        embed_class=embedding_subclass(base.get_submodule(run.embed)),
        layers=source.layout.layers_attr,
        final_norm=run.final_norm,
        lm_head=head,
        lm_head_weight=source.head_kind,
        head_input_scaled=run.head_input_scaled,
        logits_postprocessed=run.logits_postprocessed,
        logit_soft_cap=soft_cap,
        embeddings_transformed=run.embeddings_transformed,
        checkpoint_prefix_renames=prefixes,
        checkpoint_renames=tuple(r for r in checkpoint_renames(config.model_type) if r not in prefixes),
        checkpoint_roots=checkpoint_roots(model),
        checkpoint_unexpected=unexpected_suffixes(model),
        checkpoint_skipped=unexpected_prefixes(model),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        mtp_layers_field=_mtp_layers_field(config),
        vllm_sizes=_sizes_for_vllm(source, plans),
        decoder_layer=plans.decoder,
        attention=plans.attention,
        mlp=plans.mlp,
        norm=plans.norm,
        declined=plans.declined,
        moe=plans.moe,
        kept_mlps=plans.kept_mlps,
        sibling_configs=plans.siblings,
        mixer=plans.mixer,
        mixer_layer=plans.mixer_layer,
        linear_classes=source.linear_classes,
        position_embedding=run.position,
        base_init_switches=init_switches(base, small),
        head_init_switches=init_switches(model, small) if source.head_kind == EMBEDDING else (),
        base_model_inner=source.layout.inner,
        transposed_linear_classes=source.transposed_classes,
        transposed_linears=source.transposed,
        head_tied_to=_head_tied_to(source),
        forward_switches=_without_proven(
            forward_switches_of_layers(model, base, layers, plans.attention, plans.mlp, plans.moe),
            type(model).__name__,
            soft_cap,
        ),
        helper_switches=_per_class(layers, lambda layer: _helpers(model, base, layer, plans)),
        init_switches_tested=_per_class(layers, lambda layer: _init_only(model, base, layer, plans)),
    )


def _mtp_layers_field(config) -> str | None:
    """The config field counting multi-token-prediction layers, if the config has one."""
    return next((f for f in MTP_FIELDS if hasattr(config, f) and hasattr(config, "num_hidden_layers")), None)


def _per_class(layers: list[nn.Module], found) -> tuple:
    """What ``found`` gives for the first layer of each decoder-layer class, once each."""
    return tuple(dict.fromkeys(s for layer in one_per_class(layers) for s in found(layer)))


def _helpers(model, base, layer, plans) -> tuple:
    """The switches of the methods the forwards call (branches.py, ``part="helpers"``)."""
    return forward_switches(model, base, layer, plans.attention, plans.mlp, plans.moe, part="helpers")


def _init_only(model, base, layer, plans) -> tuple[tuple[str, str], ...]:
    """(class, test) of the switches the ``__init__``s test and their forwards do not."""
    args = (model, base, layer, plans.attention, plans.mlp, plans.moe)
    tested = {(owner, test) for owner, test, _ in forward_switches(*args, part="forward")}
    inits = [(owner, test) for owner, test, _ in forward_switches(*args, part="init")]
    return tuple(dict.fromkeys(s for s in inits if s not in tested))


def _without_proven(switches: tuple, causal_lm: str, soft_cap: str | None) -> tuple:
    """``switches`` less the causal LM's tests of the soft-cap field alone: the proof ran
    both of their branches (the field set, and None)."""
    if soft_cap is None:
        return switches
    return tuple(
        s
        for s in switches
        if not (s[0] == causal_lm and set(re.findall(r"\bconfig\.(\w+)", s[1])) == {soft_cap})
    )


# Config fields counting multi-token-prediction layers (vLLM's deepseek_mtp.py / glm4_moe_mtp.py
# load them as layers num_hidden_layers.. of the same checkpoint).
MTP_FIELDS = ("num_nextn_predict_layers",)


def _required(fact):
    """``fact``, unless it is a NoMatch: then analysis stops with it."""
    if isinstance(fact, NoMatch):
        raise Refusal(fact)
    return fact


def _trace_layer(layer: nn.Module, args: tuple, kwargs: dict, layer_masks: bool = False) -> Traced:
    # The tracer is best effort on unknown code: say where it stopped.
    try:
        traced = trace(layer, args, kwargs, layer_masks)
    except Exception as e:
        raise Refusal(NoMatch("trace", type(layer).__name__, error_line(e))) from e
    fold_slice_writes(traced)  # q and k written into empty tensors (DeepSeek-V3's Hub code)
    fold_manual_attention(traced)  # attention written out by hand, when proven causal
    return traced


def _layer_facts(traced: Traced, config, small, layer_type: str | None, layer_idx: int) -> LayerFacts:
    """The facts of layer ``layer_idx`` (``small``: the traced config)."""
    decoder, proven = analyze_decoder(traced), None
    if (facts := one_block_facts(traced, decoder, config, small, layer_type, layer_idx)) is not None:
        return facts  # a layer of one block (NemotronH's, Mamba-2's)
    if isinstance(decoder, NoMatch) or len(decoder.blocks) != 2:
        if isinstance(decoder, NoMatch):
            why = decoder.reason
        else:
            found = ", ".join(f"{b.norm}->{b.block}" for b in decoder.blocks)
            why = f"expected two pre-norm residual blocks (attention, MLP), found {found}"
        child, proven = proven_mixer(traced.module, small, layer_idx)
        decoder = carried_layer(traced, child)
        carried = NoMatch(
            "fused_residual_norm",
            decoder.module_class,
            f"{why}; the layer's forward is carried from the source",
        )
    else:
        blocks = decoder.blocks
        decoder = dataclasses.replace(decoder, attention_block=blocks[0].block, mlp_block=blocks[1].block)
        carried = None
    attention = block_attention(traced, decoder.attention_block, small, layer_type, layer_idx)
    attention, mixer = layer_mixer(traced, decoder, attention, small, proven, layer_idx)
    block = decoder.mlp_block
    mlp = (
        analyze_inline_mlp(traced, decoder.mlp_linears)
        if decoder.mlp_linears
        else analyze_mlp(traced, block, config)
    )
    if not isinstance(mlp, NoMatch):
        return LayerFacts(decoder, attention, mlp, None, carried, mixer)
    moe = analyze_moe(traced, block, getattr(config, "hidden_act", None) or "", config)
    if isinstance(moe, NoMatch):  # kept from the source if it can be
        # no experts at all: the dense MLP's reason is the one to give; else the experts'
        declined = mlp if moe.reason.endswith("stacked-experts modules instead of one") else moe
        kept = (
            carry_mlp(traced, block, declined, config)
            if block and not decoder.mlp_linears
            else _required(declined)
        )
        return LayerFacts(decoder, attention, None, None, carried, mixer, kept)
    names = expert_checkpoint_names(config.model_type)
    moe = dataclasses.replace(
        moe,
        checkpoint_expert_names=names or moe.checkpoint_expert_names,
        checkpoint_renames=checkpoint_renames(config.model_type)
        + (((f".{moe.router}.{moe.router_linear}.", f".{moe.router}."),) if moe.router_linear else ()),
    )
    shared = None
    if moe.shared_expert:
        shared = _required(analyze_mlp(traced, f"{block}.{moe.shared_expert}", config))
    elif decoder.shared_mlp_block:  # beside the MoE block, summed with it by the carried forward
        shared = _required(analyze_mlp(traced, decoder.shared_mlp_block, config))
    return LayerFacts(decoder, attention, shared, moe, carried, mixer)
