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

import copy
import dataclasses

import torch
import transformers
from torch import nn

from hfrewrite.analyze.attention import analyze_attention
from hfrewrite.analyze.block_output import hidden_output
from hfrewrite.analyze.branches import forward_switches
from hfrewrite.analyze.checkpoint import (
    checkpoint_prefix_renames,
    checkpoint_renames,
    checkpoint_roots,
    expert_checkpoint_names,
    unexpected_suffixes,
)
from hfrewrite.analyze.decoder import analyze_decoder, carried_layer
from hfrewrite.analyze.example_run import build_model, error_line, example_run, initialise_empty
from hfrewrite.analyze.layer_defaults import free_defaults
from hfrewrite.analyze.linear_classes import prove_linear_classes
from hfrewrite.analyze.lm_head import TRANSPOSED_WHEN_UNTIED, head_kind, is_head
from hfrewrite.analyze.manual_attention import fold_manual_attention
from hfrewrite.analyze.mla import analyze_mla, is_mla
from hfrewrite.analyze.mla_variants import with_other_branches
from hfrewrite.analyze.mlp import analyze_mlp
from hfrewrite.analyze.moe import analyze_moe
from hfrewrite.analyze.moe_variants import with_other_routings
from hfrewrite.analyze.norm import analyze_norm, config_fields
from hfrewrite.analyze.plan import (
    AttentionPlan,
    MlaPlan,
    MlpPlan,
    ModelPlan,
    MoePlan,
    NoMatch,
    NormPlan,
    Refusal,
    refuse,
)
from hfrewrite.analyze.rope import ABSOLUTE_ROTARY_FIELD
from hfrewrite.analyze.shrink import shrink_config
from hfrewrite.analyze.slice_writes import fold_slice_writes
from hfrewrite.analyze.tied_head import flipped_tie, tied_target
from hfrewrite.analyze.trace import (
    Traced,
    is_norm,
    trace,
    value,
)
from hfrewrite.analyze.traced_lines import traced_lines
from hfrewrite.analyze.transposed_linears import swap_transposed_linears
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


def _analyze(config: transformers.PretrainedConfig, branches: bool = True) -> ModelPlan:
    """The plan of ``config``; with ``branches``, the other branches of MLA's query and rope
    and of a router's string switch proven on sibling configs (analyze/mla_variants.py,
    analyze/moe_variants.py)."""
    try:
        small = shrink_config(config)
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
    torch.manual_seed(0)
    model = build_model(small)
    model.eval()
    initialise_empty(model)
    transposed_classes, transposed = swap_transposed_linears(model)  # Conv1D -> nn.Linear
    linear_classes = prove_linear_classes(model)  # before any trace: its linear leaves
    base_attr = getattr(model, "base_model_prefix", "")
    base = getattr(model, base_attr, None) if base_attr else None
    if not isinstance(base, nn.Module):  # a prefix naming no child (ERNIE-4.5's "ernie"):
        holders = [  # the one child holding the decoder stack
            name
            for name, child in model.named_children()
            if any(isinstance(m, nn.ModuleList) for m in child.children())
        ]
        if len(holders) == 1:
            base_attr, base = holders[0], getattr(model, holders[0])
    if not isinstance(base, nn.Module):
        refuse("model_layout", f"no base model at .{base_attr}", type(model).__name__)
    nested = [name for name, m in base.named_modules() if isinstance(m, nn.ModuleList) and "." in name]
    custom = bool(getattr(small, "auto_map", None))  # Hub custom code: a decoder kept deeper
    if (
        custom
        and not getattr(config, "is_encoder_decoder", False)
        and nested
        and not any(isinstance(m, nn.ModuleList) for m in base.children())
    ):
        refuse(
            "model_layout",
            f"the decoder layers sit at {base_attr}.{nested[0]}, deeper than a child of the base "
            "model (ChatGLM's encoder.layers): this analysis does not follow them there yet",
            type(base).__name__,
        )
    if getattr(config, "is_encoder_decoder", False) or not any(
        isinstance(m, nn.ModuleList) for m in base.children()
    ):
        refuse(
            "model_layout",
            "not a decoder-only causal LM (no stack of decoder layers under the base "
            "model): vLLM's decoder contract does not fit it",
            type(base).__name__,
        )
    layers_attr = _one_child(base, "ModuleList", lambda m: isinstance(m, nn.ModuleList))
    layers = list(getattr(base, layers_attr))
    if len({type(layer) for layer in layers}) != 1:
        refuse("model_layout", "decoder layers of several classes", type(base).__name__)

    embeds = [name for name, child in base.named_children() if isinstance(child, nn.Embedding)]
    if not embeds:
        refuse("model_layout", "expected an Embedding child, found none", type(base).__name__)
    head = _one_child(model, "lm_head Linear", lambda m: is_head(m, small))
    run = example_run(model, base, layers, embeds, head)
    embed = run.embed
    flipped = flipped_tie(small, build_model)
    if flipped is not None:
        initialise_empty(flipped)
    flipped_head = getattr(flipped, head, None) if flipped is not None else None
    kind = head_kind(getattr(model, head), run.head_input, run.head_output, small, flipped_head)
    final_norm = run.final_norm
    masks = not _windowed(small)  # a causal mask the base model hands its layers is proven by value
    traces = [
        _trace_layer(layer, args, kwargs, masks) for layer, (args, kwargs) in zip(layers, run.layer_inputs)
    ]
    types = getattr(small, "layer_types", None) or [None] * len(traces)
    per_layer = [_layer_facts(t, config, small, layer_type) for t, layer_type in zip(traces, types)]
    decoder = per_layer[0][0]
    declined = _compare_layers(per_layer)
    attention = _rope_layers(per_layer)
    if isinstance(attention, AttentionPlan):
        lines = traced_lines(traces[0], decoder.attention_block)
        attention = dataclasses.replace(
            attention, **_head_fields(small, attention), **_rotary_field(small, attention), traced_lines=lines
        )
    siblings: tuple = ()
    if kind == TRANSPOSED_WHEN_UNTIED:  # validated both ways
        other = copy.deepcopy(config)
        other.tie_word_embeddings = not getattr(config, "tie_word_embeddings", False)
        siblings += ((f"tie_word_embeddings={other.tie_word_embeddings} (the head's other layout)", other),)
    if branches and isinstance(attention, MlaPlan):
        attention, more, branch_configs = with_other_branches(
            config, attention, lambda other: _analyze(other, branches=False).attention
        )
        declined += more
        siblings += branch_configs
    mlp, moe = (
        _one_kind([f[2] for f in per_layer], MlpPlan),
        _one_kind([f[3] for f in per_layer], MoePlan),
    )
    if branches and moe is not None:
        router = next((m for m in model.modules() if type(m).__name__ == moe.router_class), None)
        if router is not None:
            moe, more, routings = with_other_routings(
                config, moe, router, lambda other: _analyze(other, branches=False).moe
            )
            declined += more
            siblings += routings

    layer = traces[0].module
    norm_modules = [m for _, m in layer.named_children() if is_norm(m)]
    own_norms = (
        (attention.q_a_norm, attention.kv_a_norm)
        if isinstance(attention, MlaPlan)
        else (attention.q_norm, attention.k_norm)
    )
    attention_module = layer.get_submodule(decoder.attention_block)
    for attr in own_norms:  # (a branch proven on a sibling config may have none here)
        if isinstance(getattr(attention_module, attr or "", None), nn.Module):
            norm_modules.append(attention_module.get_submodule(attr))
    norm_modules.append(getattr(base, final_norm))
    norm, why = _one_norm(norm_modules, small)
    if norm is None:
        declined += (
            NoMatch(
                "rms_norm",
                type(norm_modules[0]).__name__,
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
    if per_layer[0][4] is not None:  # the layer shape itself was not fusable
        declined += (per_layer[0][4],)
    if not decoder.fused and (hidden := hidden_output(traces[0])) is not None:
        args, kwargs = run.layer_inputs[0]  # the carried forward's inputs vLLM leaves at their defaults
        decoder = dataclasses.replace(
            decoder, free_defaults=free_defaults(layers[0], args, kwargs, value(hidden))
        )

    return ModelPlan(
        model_type=config.model_type,
        # the causal-LM class the source defines; a config may name another architecture
        # (vllm_tree / plugin register the config's names onto this class)
        architecture=type(model).__name__,
        config_class=type(model.config).__name__,
        base_model_class=type(base).__name__,
        base_model_attr=base_attr,
        embed_tokens=embed,
        embed_class=_embedding_subclass(getattr(base, embed)),
        layers=layers_attr,
        final_norm=final_norm,
        lm_head=head,
        lm_head_weight=kind,
        head_input_scaled=run.head_input_scaled,
        logits_postprocessed=run.logits_postprocessed,
        embeddings_transformed=run.embeddings_transformed,
        checkpoint_prefix_renames=checkpoint_prefix_renames(config.model_type)
        + checkpoint_prefix_renames(type(model).__name__),
        checkpoint_roots=checkpoint_roots(model),
        checkpoint_unexpected=unexpected_suffixes(model),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        mtp_layers_field=next(
            (f for f in MTP_FIELDS if hasattr(config, f) and hasattr(config, "num_hidden_layers")),
            None,
        ),
        decoder_layer=decoder,
        attention=attention,
        mlp=mlp,
        norm=norm,
        declined=declined,
        moe=moe,
        sibling_configs=siblings,
        linear_classes=linear_classes,
        position_embedding=run.position,
        transposed_linear_classes=transposed_classes,
        transposed_linears=transposed,
        head_tied_to=tied_target(model if getattr(small, "tie_word_embeddings", False) else flipped, head),
        forward_switches=forward_switches(model, base, layers[0], attention, mlp, moe),
    )


# Config fields counting multi-token-prediction layers (vLLM's deepseek_mtp.py / glm4_moe_mtp.py
# load them as layers num_hidden_layers.. of the same checkpoint).
MTP_FIELDS = ("num_nextn_predict_layers",)


def _head_fields(small, attention: AttentionPlan) -> dict:
    """The config fields that hold the head and kv-head counts, checked by value in the
    traced config (transformers maps each model's own names onto these)."""
    fields = {}
    if getattr(small, "num_attention_heads", None) == attention.num_heads:
        fields["heads_field"] = "num_attention_heads"
        if getattr(small, "num_key_value_heads", None) == attention.num_kv_heads:
            fields["kv_heads_field"] = "num_key_value_heads"
        elif (
            attention.num_kv_heads == attention.num_heads
            and getattr(small, "num_key_value_heads", None) is None
        ):
            fields["kv_heads_field"] = "num_attention_heads"
    return fields


def _rotary_field(small, attention: AttentionPlan) -> dict:
    """The config field the proven rotary width came from, when it is GPT-J's absolute one."""
    width = getattr(small, ABSOLUTE_ROTARY_FIELD, None)
    if attention.rope and attention.rotary_dim != attention.head_dim and width == attention.rotary_dim:
        return {"rotary_dim_field": ABSOLUTE_ROTARY_FIELD}
    return {}


def _embedding_subclass(module: nn.Embedding) -> str | None:
    """None for ``nn.Embedding``; for a subclass (gemma's scaled embedding), its name once
    the replay shows it computes ``lookup(ids) * scale``: the class is carried onto
    vLLM's ``VocabParallelEmbedding``, whose lookup is the same."""
    if type(module) is nn.Embedding:
        return None
    ids = torch.arange(min(16, module.num_embeddings))
    with torch.no_grad():
        out, plain = module(ids), nn.functional.embedding(ids, module.weight)
    scale = (out * plain).sum() / (plain * plain).sum()
    if not torch.allclose(out, plain * scale, atol=1e-5):
        refuse(
            "parallel_embedding",
            "the embedding computes more than a scaled lookup",
            type(module).__name__,
        )
    return type(module).__name__


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


def _required(fact):
    """``fact``, unless it is a NoMatch: then analysis stops with it."""
    if isinstance(fact, NoMatch):
        raise Refusal(fact)
    return fact


def _one_child(parent: nn.Module, what: str, test) -> str:
    """The name of the one direct child of ``parent`` that passes ``test``."""
    names = [name for name, child in parent.named_children() if test(child)]
    if len(names) != 1:
        refuse(
            "model_layout",
            f"expected one {what} child, found {names}",
            type(parent).__name__,
        )
    return names[0]


def _windowed(config) -> bool:
    """Whether the config sets any attention window (a mask over a short example run would
    look causal without it)."""
    return any("window" in key and value not in (None, False, 0) for key, value in config.to_dict().items())


def _trace_layer(layer: nn.Module, args: tuple, kwargs: dict, layer_masks: bool = False) -> Traced:
    # The tracer is best effort on unknown code: say where it stopped.
    try:
        traced = trace(layer, args, kwargs, layer_masks)
    except Exception as e:
        raise Refusal(NoMatch("trace", type(layer).__name__, error_line(e))) from e
    fold_slice_writes(traced)  # q and k written into empty tensors (DeepSeek-V3's Hub code)
    fold_manual_attention(traced)  # attention written out by hand, when proven causal
    return traced


def _layer_facts(traced: Traced, config, small, layer_type: str | None) -> tuple:
    """(DecoderLayerPlan, AttentionPlan, MlpPlan | None, MoePlan | None) of one layer
    (``small``: the traced config):
    its MLP block is either a dense gated MLP or a sparse MoE block (whose shared
    expert, if any, is a dense MLP too)."""
    decoder = analyze_decoder(traced)
    if isinstance(decoder, NoMatch) or len(decoder.blocks) != 2:
        if isinstance(decoder, NoMatch):
            why = decoder.reason
        else:
            found = ", ".join(f"{b.norm}->{b.block}" for b in decoder.blocks)
            why = f"expected two pre-norm residual blocks (attention, MLP), found {found}"
        decoder = carried_layer(traced)
        carried = NoMatch(
            "fused_residual_norm",
            decoder.module_class,
            f"{why}; the layer's forward is carried from the source",
        )
    else:
        blocks = decoder.blocks
        decoder = dataclasses.replace(decoder, attention_block=blocks[0].block, mlp_block=blocks[1].block)
        carried = None
    analyze = analyze_mla if is_mla(traced, decoder.attention_block) else analyze_attention
    attention = _required(analyze(traced, decoder.attention_block, small, layer_type))
    block = decoder.mlp_block
    mlp = analyze_mlp(traced, block, config)
    if not isinstance(mlp, NoMatch):
        return decoder, attention, mlp, None, carried
    moe = analyze_moe(traced, block, getattr(config, "hidden_act", None) or "", config)
    if isinstance(moe, NoMatch) and moe.reason.endswith("stacked-experts modules instead of one"):
        _required(mlp)  # no experts at all: the dense MLP's reason is the one to give
    moe = _required(moe)
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
    return decoder, attention, shared, moe, carried


def _one_kind(plans: list, kind: type):
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
        )
    return plan


def _compare_layers(per_layer: list[tuple]) -> tuple[NoMatch, ...]:
    """Layers must agree (dense and MoE MLP blocks may mix); a differing sliding
    window is kept as a declined fact."""
    first = per_layer[0]
    for i, (decoder, attention, *_) in enumerate(per_layer[1:], start=1):
        if (decoder, _no_window(attention)) != (first[0], _no_window(first[1])):
            refuse("uniform_layers", f"layer {i} differs", decoder.module_class)
    windows = [getattr(attention, "sliding_window", None) for _, attention, *_ in per_layer]
    if len(set(windows)) == 1:
        return ()
    reason = f"layers differ in sliding_window {windows}; the source's per-layer expression is carried"
    return (NoMatch("uniform_sliding_window", first[1].module_class, reason),)


def _no_window(attention: AttentionPlan) -> AttentionPlan:
    """The facts layers must share: sliding windows may differ, and rope may be absent
    on some layers (NoPE: cohere2's global layers), never different where present."""
    if isinstance(attention, MlaPlan):
        return attention
    return dataclasses.replace(
        attention,
        sliding_window=None,
        rope=False,
        rope_neox=True,
        rotary_dim=None,
        rope_reversed=False,
        replaced_calls=(),
    )


def _rope_layers(per_layer: list[tuple]) -> AttentionPlan:
    """The attention facts to emit: a layer with rope (all roped layers agree on it),
    marked when other layers have none."""
    plans = [attention for _, attention, *_ in per_layer]
    if isinstance(plans[0], MlaPlan):
        return plans[0]
    roped = [a for a in plans if a.rope]
    if len({(a.rope_neox, a.rotary_dim, a.rope_reversed, a.replaced_calls) for a in roped}) > 1:
        refuse("uniform_layers", "layers differ in their rope", plans[0].module_class)
    chosen = roped[0] if roped else plans[0]
    return dataclasses.replace(
        chosen,
        sliding_window=plans[0].sliding_window,
        nope_layers=bool(roped) and len(roped) != len(plans),
    )
