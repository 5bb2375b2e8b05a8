"""The analysis entry point: config -> ModelPlan (frozen facts) or one clear error.

Steps: shrink the config (:func:`shrink_config`), build the
``AutoModelForCausalLM`` on CPU with the opaque attention, read the module tree (embedding,
decoder ModuleList, final norm, lm_head), run it once on example ids to capture what each
decoder layer receives, trace every (shrunk) layer with :func:`hfrewrite.trace.trace`,
and run the pattern analyses on the traces. Each decoder-layer class is traced whole,
attention and MLP inline; their facts come from the nodes in their module scope.

A pattern that is required but does not match raises ``HfrewriteError`` naming the model
type, the module class, the pattern and the reason; facts that differ between layers in a
way the emitted code absorbs (the sliding window) are kept as ``ModelPlan.declined``.
"""

from __future__ import annotations

import copy

import torch
import transformers
from torch import nn

from hfrewrite.analyze.attention import analyze_attention
from hfrewrite.analyze.decoder import analyze_decoder
from hfrewrite.analyze.mlp import analyze_mlp
from hfrewrite.analyze.norm import analyze_norm
from hfrewrite.errors import HfrewriteError
from hfrewrite.plan import AttentionPlan, ModelPlan, NoMatch
from hfrewrite.trace import ATTN_IMPLEMENTATION, Traced, is_norm, trace

HIDDEN, HEADS, INTERMEDIATE, VOCAB = 128, 4, 256, 256
# Other size fields shrunk when the config has them (MoE and linear-attention models, so
# that they build quickly and fail in analysis, not in memory).
_OTHER_SIZES = {
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "num_experts": 4,
    "num_local_experts": 4, "num_experts_per_tok": 2, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
}


def analyze(config: transformers.PretrainedConfig) -> ModelPlan:
    """Trace a shrunk copy of ``config``'s model and return its plan; raise if unsupported."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add contention (5x slower)
    try:
        return _analyze(config)
    finally:
        torch.set_num_threads(threads)


def _analyze(config: transformers.PretrainedConfig) -> ModelPlan:
    model_type = config.model_type

    def fail(fact: NoMatch | str) -> HfrewriteError:
        return HfrewriteError(f"{model_type}: {fact}")

    small = shrink_config(config)
    torch.manual_seed(0)
    try:
        model = transformers.AutoModelForCausalLM.from_config(small, dtype=torch.float32).eval()
    except (ValueError, KeyError, ImportError) as e:
        raise fail(f"cannot build a causal LM from the config: {_line(e)}") from e
    base_attr, base = _base_model(model, fail)
    embed, layers, final_norm = _children(base, nn.Embedding, fail), _layers(base, fail), _final_norm(base, fail)
    lm_head = _lm_head(model, small.vocab_size, fail)

    traces = [_trace_layer(layer, args, kwargs, fail) for layer, (args, kwargs)
              in zip(layers, _layer_inputs(model, layers, fail))]
    per_layer = [_layer_facts(t, _activation(config), fail) for t in traces]
    decoder, attention, mlp = per_layer[0]
    declined = _compare_layers(per_layer, fail)

    norm_modules = [traces[0].module.get_submodule(b.norm) for b in decoder.blocks]
    for attr in (attention.q_norm, attention.k_norm):
        if attr is not None:
            norm_modules.append(traces[0].module.get_submodule(f"{decoder.blocks[0].block}.{attr}"))
    norms = [analyze_norm(m) for m in [*norm_modules, getattr(base, final_norm)]]
    for n in norms:
        if isinstance(n, NoMatch):
            raise fail(n)
    if len(set(norms)) != 1:
        raise fail(NoMatch("rms_norm", norms[0].module_class, f"norms differ: {sorted(set(map(str, norms)))}"))

    architectures = getattr(config, "architectures", None)
    return ModelPlan(
        model_type=model_type,
        architecture=architectures[0] if architectures else type(model).__name__,
        base_model_class=type(base).__name__,
        base_model_attr=base_attr,
        embed_tokens=embed,
        layers=_children(base, nn.ModuleList, fail),
        final_norm=final_norm,
        lm_head=lm_head,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        decoder_layer=decoder,
        attention=attention,
        mlp=mlp,
        norm=norms[0],
        declined=declined,
    )


def shrink_config(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """A small copy of ``config`` that keeps its shape ratios and flags.

    Keeps MQA (one kv head) and MHA (kv heads == heads), an explicit head_dim that is not
    hidden/heads, the biases, the tying, and one layer per distinct ``layer_types`` entry.
    """
    small = copy.deepcopy(config)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None)
    head_dim = getattr(config, "head_dim", None)
    explicit = bool(head_dim and heads and head_dim * heads != config.hidden_size)
    sizes = {"hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "vocab_size": VOCAB,
             "num_attention_heads": HEADS, **_OTHER_SIZES}
    for name, size in sizes.items():
        if isinstance(getattr(small, name, None), int):
            setattr(small, name, size)
    if kv:
        small.num_key_value_heads = 1 if kv == 1 else HEADS if kv == heads else 2
    if head_dim:
        small.head_dim = 2 * HIDDEN // HEADS if explicit else HIDDEN // HEADS
    types = getattr(config, "layer_types", None)
    distinct = list(dict.fromkeys(types)) if types else []
    small.num_hidden_layers = max(2, len(distinct))
    if distinct and not isinstance(getattr(type(small), "layer_types", None), property):
        small.layer_types = distinct + distinct[-1:] * (small.num_hidden_layers - len(distinct))
    pad = getattr(small, "pad_token_id", None)
    if isinstance(pad, int) and pad >= VOCAB:
        small.pad_token_id = None
    small._attn_implementation = ATTN_IMPLEMENTATION
    return small


def _activation(config) -> str:
    return getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or ""


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _base_model(model: nn.Module, fail) -> tuple[str, nn.Module]:
    attr = getattr(model, "base_model_prefix", "")
    base = getattr(model, attr, None) if attr else None
    if not isinstance(base, nn.Module):
        raise fail(NoMatch("model_layout", type(model).__name__, f"no base model at .{attr}"))
    return attr, base


def _children(parent: nn.Module, kind: type, fail) -> str:
    """The name of the one direct child of type ``kind``."""
    names = [n for n, m in parent.named_children() if isinstance(m, kind)]
    if len(names) != 1:
        raise fail(NoMatch("model_layout", type(parent).__name__,
                           f"expected one {kind.__name__} child, found {names}"))
    return names[0]


def _layers(base: nn.Module, fail) -> list[nn.Module]:
    layers = list(getattr(base, _children(base, nn.ModuleList, fail)))
    classes = sorted({type(layer).__name__ for layer in layers})
    if len(classes) != 1:
        raise fail(NoMatch("model_layout", type(base).__name__, f"decoder layers of several classes: {classes}"))
    return layers


def _final_norm(base: nn.Module, fail) -> str:
    names = [n for n, m in base.named_children() if is_norm(m)]
    if len(names) != 1:
        raise fail(NoMatch("model_layout", type(base).__name__, f"expected one final norm, found {names}"))
    return names[0]


def _lm_head(model: nn.Module, vocab: int, fail) -> str:
    names = [n for n, m in model.named_children() if isinstance(m, nn.Linear) and m.out_features == vocab]
    if len(names) != 1:
        raise fail(NoMatch("model_layout", type(model).__name__, f"expected one lm_head Linear, found {names}"))
    return names[0]


def _layer_inputs(model: nn.Module, layers: list[nn.Module], fail) -> list[tuple[tuple, dict]]:
    """What each decoder layer receives when the model runs on example ids."""
    captured: dict[int, tuple[tuple, dict]] = {}
    hooks = [layer.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: captured.setdefault(i, (args, kwargs)), with_kwargs=True)
        for i, layer in enumerate(layers)]
    ids = torch.arange(10).reshape(2, 5) % VOCAB
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    except Exception as e:  # a model that cannot run on CPU at all
        raise fail(f"{type(model).__name__}: example forward failed: {_line(e)}") from e
    finally:
        for h in hooks:
            h.remove()
    return [captured[i] for i in range(len(layers))]


def _trace_layer(layer: nn.Module, args: tuple, kwargs: dict, fail) -> Traced:
    try:
        return trace(layer, args, kwargs)
    except Exception as e:  # the tracer is best effort on unknown code: say where it stopped
        raise fail(f"{type(layer).__name__}: trace: {_line(e)}") from e


def _layer_facts(traced: Traced, activation: str, fail):
    decoder = analyze_decoder(traced)
    if isinstance(decoder, NoMatch):
        raise fail(decoder)
    if len(decoder.blocks) != 2:
        found = ", ".join(f"{b.norm}->{b.block}" for b in decoder.blocks)
        raise fail(NoMatch("fused_residual_norm", decoder.module_class,
                           f"expected two residual blocks (attention, MLP), found {len(decoder.blocks)}: {found}"))
    attention = analyze_attention(traced, decoder.blocks[0].block)
    if isinstance(attention, NoMatch):
        raise fail(attention)
    mlp = analyze_mlp(traced, decoder.blocks[1].block, activation)
    if isinstance(mlp, NoMatch):
        raise fail(mlp)
    return decoder, attention, mlp


def _compare_layers(per_layer: list, fail) -> tuple[NoMatch, ...]:
    """Layers must agree; a differing sliding window is kept as a declined fact."""
    first = per_layer[0]
    windows = [attention.sliding_window for _, attention, _ in per_layer]
    for i, facts in enumerate(per_layer[1:], start=1):
        same_window = (facts[0], _no_window(facts[1]), facts[2])
        if same_window != (first[0], _no_window(first[1]), first[2]):
            raise fail(NoMatch("uniform_layers", first[0].module_class, f"layer {i} differs from layer 0"))
    if len(set(windows)) == 1:
        return ()
    return (NoMatch("uniform_sliding_window", first[1].module_class,
                    f"layers differ in sliding_window {windows}; the plan keeps layer 0's"),)


def _no_window(attention: AttentionPlan) -> AttentionPlan:
    return AttentionPlan(**{**attention.__dict__, "sliding_window": None})
