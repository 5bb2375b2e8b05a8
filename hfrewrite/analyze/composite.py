"""Multimodal checkpoints whose config nests a text model's (``text_config``: Llama-4's and
Gemma-3's released checkpoints): the text model alone is converted, and the file loads it
from the multimodal checkpoint.

The text config is analysed like any; what this module adds is where the checkpoint keeps
the text model. A tiny model of the multimodal class is built and saved, and its text base
model and lm_head are found by class (the text causal LM's base model class, and the output
embeddings): their names in memory (``model.language_model.``) and on disk (what
``save_pretrained`` writes, found by value: ``language_model.model.``) become the text causal
LM's own (``model.``, ``lm_head.``), and every other part of the checkpoint (the vision tower,
the projector) is skipped. Images are not taken: the file is a text model.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from torch import nn

from hfrewrite.analyze.plan import CompositePlan, NoMatch

PATTERN = "composite_text"
# Layer counts of the parts beside the text model, cut to one in the tiny multimodal model
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "depth", "num_global_layers")


def text_part(config) -> transformers.PretrainedConfig | None:
    """The text config nested in a composite ``config`` (whose ``get_text_config`` is another
    config: Gemma-3's, Llama-4's; Fuyu's, which also keeps a vocabulary size of its own), when
    transformers has a causal LM for it; else None."""
    text = config.get_text_config()
    if text is config or getattr(text, "vocab_size", None) is None:
        return None
    return text if type(text) in transformers.AutoModelForCausalLM._model_mapping else None


def text_causal_lm(text) -> type[nn.Module]:
    """transformers' causal LM class of a text config ``text_part`` returned."""
    return transformers.AutoModelForCausalLM._model_mapping[type(text)]


def composite_class(config) -> type[nn.Module]:
    """The multimodal class of a composite ``config`` (image-text-to-text, else causal LM)."""
    for auto in (transformers.AutoModelForImageTextToText, transformers.AutoModelForCausalLM):
        if type(config) in auto._model_mapping:
            return auto._model_mapping[type(config)]
    raise KeyError(type(config).__name__)


def with_text(config, text) -> transformers.PretrainedConfig:
    """``config`` with ``text`` as its text config and the other parts one layer deep."""
    nested = {name: v for name, v in vars(config).items() if isinstance(v, transformers.PretrainedConfig)}
    text_field = next(name for name, v in nested.items() if v is config.get_text_config())
    parts = {name: v.to_dict() for name, v in nested.items() if name != text_field}
    for part in parts.values():
        for field in _LAYER_COUNTS:
            if type(part.get(field)) is int:
                part[field] = 1
    data = {**config.to_dict(), **parts, text_field: text.to_dict()}
    return type(config).from_dict(data)


def composite_plan(config, small_text) -> CompositePlan | NoMatch:
    """The checkpoint layout of ``config``'s multimodal class, its text part ``small_text``:
    built untied, so that its lm_head is saved under a name of its own."""
    cls = composite_class(config)
    text_lm = text_causal_lm(small_text)(small_text)
    embed = text_lm.get_input_embeddings()
    base_class = type(text_lm.get_submodule(_path_of(text_lm, embed).rpartition(".")[0]))
    tie = _tie_flag(cls, config, small_text)
    if tie is None:
        return NoMatch(
            PATTERN, cls.__name__, "neither its tie_word_embeddings nor its text config's ties the lm_head"
        )
    model = _built(cls, config, small_text, composite_ties=False, text_ties=False)
    bases = [name for name, m in model.named_modules() if type(m) is base_class]
    head = model.get_output_embeddings()
    if len(bases) != 1 or head is None:
        return NoMatch(PATTERN, cls.__name__, f"no one {base_class.__name__} and lm_head in the model")
    in_memory = {f"{bases[0]}.": "model.", f"{_path_of(model, head)}.": "lm_head."}
    saved = _saved(model)
    text = {**_saved_prefixes(model, saved, in_memory), **in_memory}
    names = set(model.state_dict()) | set(saved)
    skipped = {_skipped_prefix(name, text) for name in names if not name.startswith(tuple(text))}
    if None in skipped:
        return NoMatch(PATTERN, cls.__name__, "a tensor sits beside the text model's under one prefix")
    renamed = sorted((old, new) for old, new in text.items() if old != new)
    prefixes = tuple(renamed) + tuple((p, None) for p in sorted(skipped))
    return CompositePlan(cls.__name__, prefixes, tie_from_composite=tie == "composite")


def _built(cls, config, small_text, composite_ties: bool, text_ties: bool) -> nn.Module:
    """The tiny multimodal model, its lm_head tied by either config's flag as asked."""
    text = type(small_text).from_dict({**small_text.to_dict(), "tie_word_embeddings": text_ties})
    composite = with_text(config, text)
    composite.tie_word_embeddings = composite_ties
    torch.manual_seed(0)
    return cls(composite)


def _tie_flag(cls, config, small_text) -> str | None:
    """Which config's ``tie_word_embeddings`` ties the multimodal model's lm_head: "composite"
    or "text", seen on two models each tied by one flag alone; None when neither does alone."""

    def tied(model: nn.Module) -> bool:
        head = model.get_output_embeddings()
        return head is not None and head.weight is model.get_input_embeddings().weight

    by_composite = tied(_built(cls, config, small_text, composite_ties=True, text_ties=False))
    by_text = tied(_built(cls, config, small_text, composite_ties=False, text_ties=True))
    return {(True, False): "composite", (False, True): "text"}.get((by_composite, by_text))


def _path_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def _saved(model: nn.Module) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes for ``model`` (its names on disk)."""
    transformers.utils.logging.disable_progress_bar()  # stderr is for hfrewrite's one error line
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors = {}
        for path in sorted(Path(tmp).glob("*.safetensors")):
            tensors.update(load_file(path))
    return tensors


def _saved_prefixes(model: nn.Module, saved: dict, in_memory: dict[str, str]) -> dict[str, str]:
    """The on-disk prefix of each in-memory text prefix, found by the value of one of its
    tensors (a tied lm_head that is not saved has none)."""
    found = {}
    for prefix, new in in_memory.items():
        module = model.get_submodule(prefix[:-1])
        name, tensor = next(iter(module.state_dict().items()))
        keys = [k for k, v in saved.items() if k.endswith(f".{name}") and torch.equal(v, tensor)]
        if len(keys) == 1:
            found[keys[0][: -len(name)]] = new
    return found


def _skipped_prefix(name: str, text: dict[str, str]) -> str | None:
    """The shortest prefix of ``name`` that holds no text tensor (``vision_model.``,
    ``model.vision_tower.``), or None."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i]) + "."
        if not any(p.startswith(prefix) for p in text):
            return prefix
    return None
