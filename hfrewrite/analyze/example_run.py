"""The model the analysis traces: the shrunk config's causal LM built (``build_model``),
and the example run that reads the glue between its parts from the values
(``example_run``): what each decoder layer receives, the final norm, the lm_head's input."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import transformers
from torch import nn
from torch.utils._pytree import tree_map

from hfrewrite.analyze.functional_head import recording_linear, stand_in
from hfrewrite.analyze.model_layout import ModelLayout, outside_stack
from hfrewrite.analyze.plan import NoMatch, PositionEmbeddingPlan, Refusal, refuse
from hfrewrite.analyze.position_embedding import prove_position_embedding, token_embedding
from hfrewrite.analyze.position_table import base_position_table
from hfrewrite.analyze.shrink import VOCAB
from hfrewrite.analyze.trace import ATTN_IMPLEMENTATION
from hfrewrite.analyze.traced_factories import patched_torch


def error_line(e: BaseException) -> str:
    """``"<Type>: <first line>"`` of an exception the model's own code raised."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def build_model(small) -> nn.Module:
    """The causal LM of the shrunk config, with the opaque attention; code that picks its
    attention class from its own table (``ATTENTION_CLASSES[config._attn_implementation]``:
    transformers 4.36-4.47 era custom code, falcon, gptj) gets "eager", its own attention,
    traced inline (and proven like any attention written by hand)."""
    # auto_map survives only for Hub custom code the user trusted (resolve refuses it otherwise).
    custom = bool(getattr(small, "auto_map", None))
    try:
        with _empty_is_nan():
            return transformers.AutoModelForCausalLM.from_config(
                small, dtype=torch.float32, trust_remote_code=custom
            )
    except KeyError as e:
        if e.args[:1] != (ATTN_IMPLEMENTATION,):  # not the missing entry of its own attention table
            raise Refusal(NoMatch("", "", f"cannot build a causal LM: {error_line(e)}")) from e
    except Exception as e:  # the modeling code cannot build this config
        raise Refusal(NoMatch("", "", f"cannot build a causal LM from the config: {error_line(e)}")) from e
    small._attn_implementation = "eager"
    try:
        with _empty_is_nan():
            return transformers.AutoModelForCausalLM.from_config(
                small, dtype=torch.float32, trust_remote_code=custom
            )
    except Exception as e:
        raise Refusal(NoMatch("", "", f"cannot build a causal LM from the config: {error_line(e)}")) from e


def _empty_is_nan():
    """``torch.empty`` and ``torch.empty_like`` (``skip_init``'s ``to_empty``) floats hold
    NaN while the model is built, not whatever memory held (tiny denormals as often as NaN):
    a parameter no initialiser writes is then always seen by ``initialise_empty``."""

    def nan_filled(original):
        def call(*args, **kwargs):
            tensor = original(*args, **kwargs)
            return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

        return call

    return patched_torch(("empty", "empty_like"), nan_filled)


@dataclasses.dataclass
class ExampleRun:
    layer_inputs: list[tuple[tuple, dict]]  # (args, kwargs) each decoder layer received
    final_norm: str  # the base model's child between the last layer and the lm_head ("": none)
    logits_postprocessed: bool  # the logits differ from lm_head(hidden): softcap, scale...
    embeddings_transformed: bool  # the first layer does not read the embedding as it is
    head_input: torch.Tensor | None = None  # what the lm_head read and returned
    head_output: torch.Tensor | None = None
    head_input_scaled: bool = False  # the lm_head reads the final norm's output times a constant
    embed: str = ""  # the embedding called on the input ids
    position: PositionEmbeddingPlan | None = None  # a position table added to its rows


def example_run(model: nn.Module, layout: ModelLayout) -> ExampleRun:
    """Run the model once on ids and read the glue between its parts from the values:
    what each layer receives, which of the base model's ``embeds`` looks up the tokens and
    whether another adds position rows to them, whether the first layer receives the
    embedding unchanged,
    which child normalises the last layer's output into the lm_head, and whether the
    logits are post-processed. The vLLM model interface writes that glue itself and
    carries the source's statements where the values show there are some."""
    base, layers, embeds, head = layout.base, layout.layers, layout.embeds, layout.head
    stack = layout.layers_attr if layout.nested else ""
    run = _recorded_run(model, base, layers, head, stack, layout.head_weight)
    seen, calls = run.layer_inputs, run.calls
    if layout.head_weight and not (head in calls and _same(calls[head][1], run.logits)):
        raise Refusal(
            NoMatch(
                "model_layout",
                type(model).__name__,
                f"no lm_head module, and no F.linear call with {layout.head_weight}.weight computes the logits",
            )
        )
    first = seen[0][0][0] if seen[0][0] else next(iter(seen[0][1].values()))
    embedded = _tokens_embedded(base, embeds, calls, run.ids, first)
    head_in = calls[head][0]
    norm, scaled = _final_norm(base, run.children[:-1], calls, head_in)
    # sequence-first layers (ChatGLM): the embeddings and the logits are transposed around
    # them, a layout vLLM's flat [tokens, hidden] rows do not have
    seq_first = stack != "" and _same(_transposed(embedded.start), first)
    return ExampleRun(
        layer_inputs=[seen[i] for i in range(len(layers))],
        final_norm=norm,
        logits_postprocessed=not _same(
            _transposed(calls[head][1]) if seq_first else calls[head][1], run.logits
        ),
        embeddings_transformed=not (seq_first or _same(embedded.start, first)),
        head_input=head_in[0] if isinstance(head_in, tuple | list) else head_in,
        head_input_scaled=scaled,
        head_output=calls[head][1],
        embed=embedded.embed,
        position=embedded.position,
    )


@dataclasses.dataclass(frozen=True)
class _RecordedRun:
    """What forward hooks read on one run of the model on ``ids``."""

    ids: torch.Tensor
    logits: torch.Tensor
    layer_inputs: dict[int, tuple[tuple, dict]]  # layer index -> the (args, kwargs) it received
    calls: dict[str, tuple]  # child (the lm_head too; "<last>": the last layer) -> (args, output)
    children: list[tuple[str, nn.Module]]  # the base model's children but layer lists, then the lm_head


def _record(store: dict, key, value) -> None:  # hooks must return None
    store[key] = value  # the last call: a final norm may also run on the embeddings


def _record_copy(store: dict, key, value) -> None:
    """Record copies: the caller may change a returned tensor in place afterwards (CTRL's
    ``inputs_embeds *= np.sqrt(d)``), and the values must be those the child returned."""
    store[key] = tree_map(lambda x: x.detach().clone() if torch.is_tensor(x) else x, value)


def _recorded_run(
    model: nn.Module,
    base: nn.Module,
    layers: list[nn.Module],
    head: str,
    stack: str = "",
    head_weight: str = "",
) -> _RecordedRun:
    """Run the model once on ids, hooks recording what each decoder layer receives and what
    each child of the base model (each module outside the decoder ``stack`` where that sits
    deeper), the lm_head and the last layer read and return (``head_weight``: no lm_head
    module, the ``F.linear`` call with that embedding's weight recorded as the head's)."""
    seen: dict[int, tuple[tuple, dict]] = {}
    calls: dict[str, tuple] = {}
    hooks = [
        layer.register_forward_pre_hook(
            lambda _, args, kwargs, i=i: _record(seen, i, (args, kwargs)),
            with_kwargs=True,
        )
        for i, layer in enumerate(layers)
    ]
    children = [
        (name, child)
        for name, child in (outside_stack(base, stack) if stack else base.named_children())
        if not isinstance(child, nn.ModuleList)
    ]
    children.append((head, stand_in(model, head_weight) if head_weight else model.get_submodule(head)))
    hooks += [
        child.register_forward_hook(lambda _, args, out, name=name: _record_copy(calls, name, (args, out)))
        for name, child in children
    ]
    hooks.append(
        layers[-1].register_forward_hook(lambda _, args, out: _record_copy(calls, "<last>", (args, out)))
    )
    ids = torch.arange(10).reshape(2, 5) % VOCAB
    weight = model.get_submodule(head_weight).weight if head_weight else None
    recording = recording_linear(weight, calls, head) if head_weight else contextlib.nullcontext()
    try:
        with torch.no_grad(), recording:
            logits = model(input_ids=ids, use_cache=False).logits
    except Exception as e:  # a model that cannot run on CPU at all
        raise Refusal(NoMatch("example run", type(model).__name__, error_line(e))) from e
    finally:
        for hook in hooks:
            hook.remove()
    return _RecordedRun(ids=ids, logits=logits, layer_inputs=seen, calls=calls, children=children)


def _transposed(x):
    """``x`` (or its first item) with its first two dims swapped."""
    x = x[0] if isinstance(x, tuple | list) else x
    return x.transpose(0, 1) if torch.is_tensor(x) and x.dim() >= 2 else x


def _same(a, b) -> bool:
    """The same tensor values (of the first item, for tuples and lists)."""
    a, b = (x[0] if isinstance(x, (tuple, list)) else x for x in (a, b))
    return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)


@dataclasses.dataclass(frozen=True)
class _TokensEmbedded:
    """How the input ids become the rows the first layer would receive unchanged."""

    embed: str  # the embedding called on the input ids
    position: PositionEmbeddingPlan | None  # a position table added to its rows
    start: torch.Tensor  # the embedding's output, plus the position rows where there are some


def _tokens_embedded(
    base: nn.Module, embeds: list[str], calls: dict, ids: torch.Tensor, first
) -> _TokensEmbedded:
    """Which of ``embeds`` looks up the tokens, and the position rows another adds to
    them (proven against ``first``, what the first layer receives)."""
    embed = token_embedding(base, embeds, calls, ids)
    if embed is None:
        refuse(
            "model_layout",
            f"not exactly one of the embeddings {embeds} looks up the input ids",
            type(base).__name__,
        )
    start, position = calls[embed][1], None
    if len(embeds) > 2:
        refuse("model_layout", f"embeddings {embeds}: more than tokens and positions", type(base).__name__)
    if len(embeds) == 2:
        other = next(e for e in embeds if e != embed)
        position = prove_position_embedding(
            other, base.get_submodule(other), calls.get(other, (None, None))[1], start, first
        )
        if isinstance(position, NoMatch):
            raise Refusal(position)
        start = first  # proven: the tokens' rows plus the position rows
    elif not _same(start, first) and (position := base_position_table(base, start, first)) is not None:
        start = first  # proven: the tokens' rows, maybe scaled, plus a base buffer's rows
    return _TokensEmbedded(embed=embed, position=position, start=start)


def _final_norm(
    base: nn.Module, children: list[tuple[str, nn.Module]], calls: dict, head_in
) -> tuple[str, bool]:
    """The one child that normalises the last layer's output into the lm_head, and whether
    the lm_head reads its output times a constant."""
    last = calls["<last>"][1]
    norms = [
        name
        for name, _ in children
        if name in calls and _same(calls[name][0], last) and _same(calls[name][1], head_in)
    ]
    scaled = False
    if not norms:  # MiniCPM: the lm_head reads the final norm's output divided by a constant
        norms = [
            name
            for name, _ in children
            if name in calls and _same(calls[name][0], last) and _scaled(calls[name][1], head_in)
        ]
        scaled = bool(norms)
    if not norms and _same(last, head_in):  # GPT-1: the lm_head reads the last layer's output
        return "", False
    if len(norms) != 1:
        readers = [
            f"{n} ({type(c).__name__})" for n, c in children if n in calls and _same(calls[n][0], last)
        ]
        read = f" (the last layer's output is read by {', '.join(readers)})" if readers else ""
        refuse(
            "model_layout",
            f"no one child normalises the last layer's output into the lm_head{read}",
            type(base).__name__,
        )
    return norms[0], scaled


def initialise_empty(model: nn.Module) -> None:
    """Parameters the source leaves uninitialised (``torch.empty`` and an ``_init_weights``
    that skips them: Baichuan-13B's norms, ChatGLM's ``skip_init``) hold NaN (``build_model``
    fills what memory held with it): drawn like transformers' defaults instead, so that values
    can prove things."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point() and not (torch.isfinite(param).all() and param.abs().max() < 1e4):
                fresh = torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.02
                param.copy_(fresh + 1.0 if param.dim() == 1 else fresh)


def _scaled(a, b) -> bool:
    """``b`` is ``a`` times one constant other than 1 (checked on every element)."""
    a, b = (x[0] if isinstance(x, tuple | list) else x for x in (a, b))
    if not (torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and a.abs().min() > 0):
        return False
    ratio = (b / a).flatten()
    return bool(torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-5)) and not torch.isclose(
        ratio[0], torch.tensor(1.0, dtype=ratio.dtype)
    )
