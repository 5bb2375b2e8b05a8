"""Where a causal LM keeps its parts, found in its module tree: the base model, its decoder
ModuleList, its Embedding children and the lm_head; and whether its embedding class is one
vLLM's ``VocabParallelEmbedding`` computes.

A layout this analysis does not follow (no base model, an encoder-decoder, a decoder stack
deeper than a child of the base model outside Hub code) refuses with the ``model_layout``
pattern. Hub code whose parts sit one level deeper (ChatGLM3's ``encoder.layers``) is
followed there; analyze/flat_layout.py names them for the flat file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from hfrewrite.analyze.functional_head import HEAD, embedding_head
from hfrewrite.analyze.lm_head import is_head
from hfrewrite.analyze.plan import refuse


@dataclass(frozen=True)
class ModelLayout:
    """The parts of a causal LM ``model``, by attribute name."""

    base_attr: str  # model.<base_attr>: the base model
    base: nn.Module  # (model.<base_attr>.<inner> when the base model only wraps it)
    inner: str  # OPT's "decoder": the child of the base model holding the stack, else ""
    layers_attr: str  # base.<layers_attr>: the decoder layers' ModuleList (dotted when nested)
    layers: list[nn.Module]
    embeds: list[str]  # the base model's Embedding children (dotted paths when nested)
    head: str  # model.<head>: the lm_head (ChatGLM's "transformer.output_layer" when nested)
    # the parts sit at several depths of the base model (ChatGLM's embedding.word_embeddings,
    # encoder.layers, encoder.final_layernorm, output_layer): the file flattens them
    nested: bool = False
    # no lm_head module: the logits are computed with this embedding's weight by a function
    # call (OpenELM's F.linear; analyze/functional_head.py), and ``head`` names the one the file builds
    head_weight: str = ""


def model_layout(model: nn.Module, config, small) -> ModelLayout:
    """The layout of ``model`` (built from ``small``, the shrunk ``config``), or a refusal."""
    base_attr, base = _base_model(model)
    inner = _wrapped_stack(base, config)
    base = getattr(base, inner) if inner else base
    nested = _nested_stack(base, config) if getattr(small, "auto_map", None) else ""  # Hub code
    if not nested:
        _refuse_unfollowed_stack(base, f"{base_attr}.{inner}" if inner else base_attr, config, small)
    # (a list of parameter-free modules is not the stack: Granite-SWA's rotary embeddings per base)
    layers_attr = nested or _one_child(
        base, "ModuleList", lambda m: isinstance(m, nn.ModuleList) and next(m.parameters(), None) is not None
    )
    layers = list(base.get_submodule(layers_attr))
    _refuse_other_towers(base, layers_attr)
    parts = outside_stack(base, layers_attr) if nested else list(base.named_children())
    embeds = [name for name, child in parts if isinstance(child, nn.Embedding)]
    embeds += [name for name, child in parts if buffer_table(child)]  # XGLM's
    if not embeds:
        refuse("model_layout", _no_embedding_reason(base, layers_attr), type(base).__name__)
    heads = [name for name, child in model.named_children() if is_head(child, small)]
    if nested and not heads:  # ChatGLM's transformer.output_layer
        heads = [
            f"{base_attr}.{n}" for n, m in parts if is_head(m, small) and not isinstance(m, nn.Embedding)
        ]
    prefix = f"{base_attr}.{inner}" if inner else base_attr
    weight = embedding_head(model, prefix, embeds, small.vocab_size) if not heads else None
    if weight is not None:  # the example run proves the logits come from it (example_run.py)
        return ModelLayout(base_attr, base, inner, layers_attr, layers, embeds, HEAD, bool(nested), weight)
    if len(heads) != 1:
        refuse("model_layout", f"expected one lm_head Linear child, found {heads}", type(model).__name__)
    return ModelLayout(base_attr, base, inner, layers_attr, layers, embeds, heads[0], bool(nested))


def _no_embedding_reason(base: nn.Module, layers_attr: str) -> str:
    """No Embedding child: where the embeddings sit instead, if deeper."""
    deeper = [
        f"{name}, inside {type(base.get_submodule(name.rsplit('.', 1)[0])).__name__}"
        for name, m in outside_stack(base, layers_attr)
        if isinstance(m, nn.Embedding)
    ]
    if not deeper:
        return "expected an Embedding child, found none"
    return (
        f"no Embedding is a child of the base model: it sits deeper ({'; '.join(deeper)}), and the analysis "
        "reads the tokens' embedding off a child of the base model"
    )


def _refuse_other_towers(base: nn.Module, layers_attr: str) -> None:
    """A pretrained model of its own beside the decoder stack (Phi-4-multimodal's vision and
    audio encoders, built under its embedding): the file would build the tower a text decoder
    has no use for, from a class it does not keep."""
    towers = [
        f"{name} ({type(m).__name__})"
        for name, m in outside_stack(base, layers_attr)
        if isinstance(m, PreTrainedModel) and not layers_attr.startswith(f"{name}.")
    ]
    if towers:
        refuse(
            "model_layout",
            f"the base model holds another pretrained model beside its decoder stack: {', '.join(towers)} "
            "(a vision or audio encoder of a multimodal model); hfrewrite converts text decoders",
            type(base).__name__,
        )


def outside_stack(base: nn.Module, layers_attr: str) -> list[tuple[str, nn.Module]]:
    """The modules of ``base`` at any depth, the decoder stack and what it holds left out."""
    return [
        (name, m)
        for name, m in base.named_modules()
        if name and name != layers_attr and not name.startswith(f"{layers_attr}.")
    ]


def _nested_stack(base: nn.Module, config) -> str:
    """The dotted path of the one decoder ModuleList deeper than a child of ``base``, when
    ``base`` holds none itself (ChatGLM's ``encoder.layers``; not an encoder-decoder), else "".
    """
    if getattr(config, "is_encoder_decoder", False) or any(
        isinstance(m, nn.ModuleList) for m in base.children()
    ):
        return ""
    lists = [name for name, m in base.named_modules() if isinstance(m, nn.ModuleList)]
    return lists[0] if len(lists) == 1 and lists[0].count(".") == 1 else ""


def buffer_table(module: nn.Module) -> str | None:
    """The one 2-d float buffer of a module with no parameters (XGLM's sinusoidal position
    table, built from the config), else None: a position table example_run may prove."""
    if isinstance(module, nn.Embedding) or next(module.parameters(), None) is not None:
        return None
    tables = [n for n, b in module.named_buffers(recurse=False) if b.dim() == 2 and b.is_floating_point()]
    return tables[0] if len(tables) == 1 and len(list(module.buffers())) == 1 else None


def flattened(path: str | None, layout: ModelLayout) -> str | None:
    """A module path of the source model as the file builds it: the wrapped stack's holder
    (OPT's ``model.decoder``) is the base model itself there."""
    if path is None or not layout.inner:
        return path
    return path.replace(f"{layout.base_attr}.{layout.inner}.", f"{layout.base_attr}.", 1)


def _wrapped_stack(base: nn.Module, config) -> str:
    """The one child of ``base`` holding the decoder stack, when ``base`` holds no stack
    itself and only that child (OPT's ``model.decoder``; not an encoder-decoder), else ""."""
    if getattr(config, "is_encoder_decoder", False) or any(
        isinstance(m, nn.ModuleList) for m in base.children()
    ):
        return ""
    children = list(base.named_children())
    if len(children) == 1 and any(isinstance(m, nn.ModuleList) for m in children[0][1].children()):
        return children[0][0]
    return ""


def _base_model(model: nn.Module) -> tuple[str, nn.Module]:
    """(attribute, module) of the base model: the one ``base_model_prefix`` names, else the
    one child holding the decoder stack."""
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
    return base_attr, base


def _refuse_unfollowed_stack(base: nn.Module, base_attr: str, config, small) -> None:
    """Refuse a decoder stack this analysis does not follow: Hub code whose ModuleLists sit
    deeper, but not as the one stack ``_nested_stack`` follows (several, or deeper than a
    child's child), or none (an encoder-decoder, no decoder layers)."""
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
            f"ModuleLists {nested} sit under {base_attr}, none as its child: the analysis follows "
            "one decoder stack held by a child of the base model (ChatGLM3's encoder.layers), not these",
            type(base).__name__,
        )
    if getattr(config, "is_encoder_decoder", False):
        refuse(
            "model_layout",
            "an encoder-decoder model (is_encoder_decoder): vLLM's decoder contract does not fit it",
            type(base).__name__,
        )
    if not any(isinstance(m, nn.ModuleList) for m in base.children()):
        shown = ", ".join(nested[:3]) + (", ..." if len(nested) > 3 else "")
        refuse(
            "model_layout",
            f"no list of layers is a child of the base model; its lists sit deeper ({shown}), as in "
            "BERT-style encoder stacks and models that run their layers in cycles: the analysis "
            "follows one list of decoder layers under the base model"
            if nested
            else "no list of layers under the base model: not a stack of decoder layers",
            type(base).__name__,
        )


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


def embedding_subclass(module: nn.Embedding) -> str | None:
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
