"""type_config_params: `config` is annotated where every call hands it the model configuration."""

import dataclasses

import pytest
from hfrewrite.passes import type_config_params

from tests.passes.harness import apply
from tests.passes.plans import llama_like

PLAN = dataclasses.replace(llama_like(), config_class="LlamaConfig")

BASE = """
from transformers import LlamaConfig


class LlamaMLP(nn.Module):
    def __init__(self, config, size=None):
        super().__init__()


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.mlp = LlamaMLP(config)


class LlamaModel(nn.Module):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.layers = make_layers(2, lambda prefix: LlamaDecoderLayer(config))
        self.extra = LlamaMLP(config, 4)
"""


def typed(source: str, plan=PLAN) -> tuple[str, int]:
    result = apply(type_config_params, source, plan)
    return result.module.code, result.matches


def one_change(old: str, new: str) -> str:
    assert BASE.count(old) == 1, old
    return BASE.replace(old, new)


def test_the_config_is_followed_from_vllm_config_into_the_layers():
    code, matches = typed(BASE)
    assert "def __init__(self, config: LlamaConfig, size=None):" in code
    assert "def __init__(self, config: LlamaConfig):" in code  # proven, kept as it was
    assert matches == 1


@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        (
            "self.extra = LlamaMLP(config, 4)",
            "self.extra = LlamaMLP(config.text_config, 4)",
            "one call passes something else",
        ),
        (
            "self.mlp = LlamaMLP(config)",
            "self.mlp = LlamaMLP(size=3)",
            "one call leaves the default",
        ),
        (
            "config = vllm_config.model_config.hf_config",
            "config = vllm_config.model_config.hf_config\n        config = config.sub",
            "the name is rebound",
        ),
        (
            "lambda prefix: LlamaDecoderLayer(config)",
            "lambda config: LlamaDecoderLayer(config)",
            "a lambda parameter shadows it",
        ),
        (
            "lambda prefix: LlamaDecoderLayer(config)",
            "lambda prefix: LlamaDecoderLayer(vllm_config)",
            "the source's annotation on the decoder layer is no proof",
        ),
        (
            "self.extra = LlamaMLP(config, 4)",
            "self.extra = LlamaMLP(config, 4)\n    def f(self, c):\n        return LlamaMLP(c)",
            "a call from a method the pass cannot follow",
        ),
    ],
)
def test_the_mlp_config_stays_untyped_without_proof(old, new, why):
    code, _ = typed(one_change(old, new))
    assert "def __init__(self, config, size=None):" in code, why


def test_nothing_is_typed_when_the_class_is_not_imported():
    code, matches = typed(one_change("from transformers import LlamaConfig\n", ""))
    assert matches == 0 and "def __init__(self, config, size=None):" in code


TABLED = one_change(
    "        self.layers = make_layers(2, lambda prefix: LlamaDecoderLayer(config))\n",
    "        self.layers = make_layers(2, lambda prefix: LAYERS[config.kinds[0]](config))\n",
).replace("\n\nclass LlamaModel", '\n\nLAYERS = {"attention": LlamaDecoderLayer}\n\n\nclass LlamaModel')


def test_the_config_is_followed_through_a_table_of_layer_classes():
    """Jamba's base model builds each layer as ``ALL_DECODER_LAYER_TYPES[kind](config, ...)``:
    a call of each class of the table."""
    code, _ = typed(TABLED)
    assert "def __init__(self, config: LlamaConfig, size=None):" in code


def test_a_table_read_otherwise_than_called_is_no_proof():
    code, _ = typed(TABLED + "\nKINDS = list(LAYERS)\n")
    assert "def __init__(self, config, size=None):" in code
