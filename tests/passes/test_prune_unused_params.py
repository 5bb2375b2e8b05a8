"""prune_unused_params: unread parameters go with their arguments, only where every call is known."""

import pytest
from hfrewrite.passes import prune_unused_params

from tests.passes.harness import apply
from tests.passes.plans import llama_like

PLAN = llama_like()

BASE = """
class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, scale=1.0):
        super().__init__()
        self.scale = scale * config.hidden_size

    def forward(self, x):
        return x * self.scale


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, scale=2.0)

    def forward(self, x):
        return self.self_attn(x)


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = [LlamaDecoderLayer(config, extract_layer_index(p)) for p in ("a.0",)]

    def forward(self, x):
        return self.layers[0](x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = LlamaModel(config)

    def forward(self, x):
        return self.model(x)
"""


def pruned(source: str) -> tuple[str, int]:
    result = apply(prune_unused_params, source, PLAN)
    return result.module.code, result.matches


def one_change(old: str, new: str) -> str:
    assert BASE.count(old) == 1, old
    return BASE.replace(old, new)


def test_unread_parameters_go_with_their_arguments_to_a_fixpoint():
    code, matches = pruned(BASE)
    assert matches == 2  # the attention's layer_idx, then the decoder layer's
    assert "def __init__(self, config, scale=1.0):" in code
    assert "LlamaAttention(config, scale=2.0)" in code
    assert "def __init__(self, config):" in code
    assert "LlamaDecoderLayer(config)" in code
    assert "layer_idx" not in code and "extract_layer_index" not in code


@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        (
            "class LlamaModel(nn.Module):",
            "class Sub(LlamaAttention):\n    pass\n\n\nclass LlamaModel(nn.Module):",
            "subclassed: a super().__init__ elsewhere may pass it",
        ),
        (
            "LlamaAttention(config, layer_idx, scale=2.0)",
            "LlamaAttention(config, *args)",
            "a call unpacks its arguments",
        ),
        (
            "LlamaAttention(config, layer_idx, scale=2.0)",
            "LlamaAttention(config, next(counter), scale=2.0)",
            "the argument has side effects",
        ),
        (
            "self.scale = scale * config.hidden_size",
            "self.scale = scale * len(locals())",
            "the body introspects its locals",
        ),
        (
            "self.self_attn = LlamaAttention(config, layer_idx, scale=2.0)",
            "self.self_attn = LlamaAttention(config, layer_idx, scale=2.0)\n        self.kind = LlamaAttention",
            "the class is used as a value",
        ),
    ],
)
def test_the_attention_keeps_layer_idx_when_not_every_call_is_known(old, new, why):
    code, _ = pruned(one_change(old, new))
    assert "def __init__(self, config, layer_idx: int, scale=1.0):" in code, why


def test_isinstance_checks_do_not_stop_pruning():
    code, matches = pruned(
        one_change(
            "        self.scale = scale * config.hidden_size",
            "        self.scale = scale * config.hidden_size\n        assert not isinstance(self, LlamaAttention) or True",
        )
    )
    assert "def __init__(self, config, scale=1.0):" in code and matches == 2


def test_a_keyword_argument_is_dropped_as_well():
    code, matches = pruned(
        one_change(
            "LlamaAttention(config, layer_idx, scale=2.0)",
            "LlamaAttention(config=config, layer_idx=layer_idx)",
        )
    )
    assert "LlamaAttention(config=config)" in code and matches == 2


def test_nothing_to_prune_reports_no_match():
    source = one_change(
        "self.scale = scale * config.hidden_size",
        "self.scale = scale * config.hidden_size * layer_idx",
    )
    code, matches = pruned(source)
    assert matches == 0 and "layer_idx" in code
