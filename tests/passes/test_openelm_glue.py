"""The pieces OpenELM's Hub code needed, each on its own: layout statements dropped before a
proven split, a GQA expansion under a switch, the config shim's sizes and its own
``__post_init__``, the relative imports of the shim's helpers, and a layer list built from a
generator."""

from __future__ import annotations

import ast
from pathlib import Path

import libcst as cst
import pytest
from hfrewrite.passes.vllm_model_interface import _layer_stack

from hfrewrite.emit.config_shim import OWN_POST_INIT, shim_statements
from hfrewrite.emit.kv_expansion import kv_expansion
from hfrewrite.emit.relative_imports import relative_imports, with_absolute_imports
from hfrewrite.emit.relayout import relayout

STATES = {"keys": "k", "values": "v", "queries": "q"}


@pytest.mark.parametrize(
    "line, expected",
    [
        ("qkv = qkv.reshape(b, s, h, d)\n", True),
        ("qkv = qkv.reshape(b, s, h, d).transpose(1, 2)\n", True),
        ("qkv = qkv.transpose(1, 2) * 2\n", False),  # a product is no layout
        ("qkv = qkv.clamp(-1, 1)\n", False),
        ("qkv = other.reshape(b, s, h, d)\n", False),  # another tensor's layout
        ("qkv = qkv\n", False),
    ],
)
def test_only_layout_statements_on_the_projection_are_relayouts(line, expected):
    assert relayout(cst.parse_statement(line), "qkv") is expected


ALLOWED = {"repeat_interleave", "reshape", "transpose"}


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            (
                "if self.num_groups != 1:\n"
                "    keys = keys.repeat_interleave(self.num_groups, dim=1)\n"
                "    values = values.repeat_interleave(self.num_groups, dim=1)\n"
            ),
            True,
        ),
        # q touched too: not an expansion of k and v alone
        ("if self.n != 1:\n    queries = queries.repeat_interleave(2, dim=1)\n", False),
        # a layout of k under the switch: another config would lay k out otherwise
        ("if self.n != 1:\n    keys = keys.transpose(1, 2)\n", False),
        # an else branch: not this form
        ("if self.n != 1:\n    keys = keys.repeat_interleave(2, dim=1)\nelse:\n    keys = keys * 2\n", False),
    ],
)
def test_a_switch_around_a_gqa_expansion_of_k_and_v(source, expected):
    assert kv_expansion(cst.parse_statement(source), ALLOWED, STATES) is expected


def test_an_expansion_the_plan_does_not_account_for_stays():
    source = "if self.n != 1:\n    keys = keys.repeat_interleave(2, dim=1)\n"
    assert not kv_expansion(cst.parse_statement(source), {"reshape"}, STATES)


CONFIG = """\
from transformers import PretrainedConfig


def make_divisible(v, divisor=8):
    return max(divisor, int(v + divisor / 2) // divisor * divisor)


def unused_helper():
    return 1


class TinyConfig(PretrainedConfig):
    model_type = "tiny"

    def __init__(self, model_dim=64, num_transformer_layers=2, heads=(2, 4), **kwargs):
        self.model_dim = model_dim
        self.num_transformer_layers = num_transformer_layers
        self.heads = list(heads)
        self.__post_init__()
        super().__init__(**kwargs)

    def __post_init__(self):
        self.width = make_divisible(self.model_dim)
"""


def test_the_shim_gives_vllm_its_sizes_and_keeps_its_own_post_init(tmp_path: Path):
    path = tmp_path / "configuration_tiny.py"
    path.write_text(CONFIG)
    sizes = (("hidden_size", "self.model_dim"), ("num_hidden_layers", "self.num_transformer_layers"))
    code = cst.Module(
        body=shim_statements(path, "TinyConfig", "tiny", sizes, frozenset({"unused_helper"}))
    ).code
    namespace: dict = {}
    exec(compile(code, "<shim>", "exec"), namespace)  # noqa: S102 - the test's own class
    config = namespace["TinyConfig"](model_dim=96)
    assert (config.hidden_size, config.num_hidden_layers, config.width) == (96, 2, 96)
    assert f"def {OWN_POST_INIT}(self)" in code and "def __post_init__" not in code
    assert "def unused_helper" in code  # the modeling file imports it: carried too
    config.hidden_size = 96  # (transformers sets what a config.json names: the same value passes)
    with pytest.raises(ValueError, match="disagrees"):
        config.hidden_size = 32


def test_the_shims_helpers_are_used_as_the_file_defines_them():
    module = cst.parse_module(
        "import torch\nfrom .configuration_tiny import TinyConfig, make_divisible\n\n"
        "def f(config: TinyConfig):\n    return make_divisible(config.model_dim)\n"
    )
    _, configs = relative_imports(module)
    out = with_absolute_imports(
        module,
        configs,
        lambda n: {x.id for x in ast.walk(ast.parse(cst.Module([n]).code)) if isinstance(x, ast.Name)},
        custom_code=True,
        modeling_file="modeling_tiny.py",
        shim_helpers=frozenset({"make_divisible"}),
    ).code
    assert "def f(config: PretrainedConfig):" in out and "return make_divisible(config.model_dim)" in out
    assert "configuration_tiny" not in out


def test_a_layer_list_built_from_a_generator():
    value = cst.parse_expression("nn.ModuleList(Layer(config=config, layer_idx=i) for i in range(config.n))")
    made = _layer_stack(value, "Model", "layers")
    assert "config.n," in made and "Layer(config=config, layer_idx=extract_layer_index(prefix)," in made
