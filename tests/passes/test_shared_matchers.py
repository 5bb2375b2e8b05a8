"""The matchers passes share (emit/shared_matchers.py) match the shapes by structure: spacing,
comments and line breaks do not matter, another shape does."""

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit.shared_matchers import (
    ACT2FN_ENTRY,
    QKV_PROJECTION,
    SUPER_INIT,
    SUPER_INIT_BARE,
    SUPER_INIT_CALL,
    TP_SIZE_LOCAL,
    builds,
    nn_call,
    same,
    self_attr,
)


def _stmt(code: str) -> cst.BaseStatement:
    return cst.parse_statement(code)


def test_the_fused_projection_fuse_qkv_writes_is_found_however_it_is_laid_out():
    assert m.matches(_stmt("qkv, _ = self.W_pack(hidden_states)\n"), QKV_PROJECTION)
    assert m.matches(_stmt("qkv, _ = self.qkv_proj(  # fused\n    x\n)\n"), QKV_PROJECTION)
    assert not m.matches(_stmt("qkv = self.qkv_proj(x)\n"), QKV_PROJECTION)
    assert not m.matches(_stmt("qkv, _ = proj(x)\n"), QKV_PROJECTION)


def test_super_init_and_the_tp_size_local():
    assert m.matches(cst.parse_expression("super().__init__"), SUPER_INIT)
    assert not m.matches(cst.parse_expression("super(Foo, self).__init__"), SUPER_INIT)
    assert m.matches(_stmt("tp_size = get_tensor_model_parallel_world_size()\n"), TP_SIZE_LOCAL)
    assert not m.matches(_stmt("tp_size = get_tensor_model_parallel_world_size(group)\n"), TP_SIZE_LOCAL)


def test_super_init_statements_bare_or_with_arguments():
    assert m.matches(_stmt("super().__init__()  # the module\n"), SUPER_INIT_BARE)
    assert not m.matches(_stmt("super().__init__(config)\n"), SUPER_INIT_BARE)
    assert m.matches(_stmt("super().__init__(config); self.x = 1\n"), SUPER_INIT_CALL)
    assert not m.matches(_stmt("super(Foo, self).__init__(config)\n"), SUPER_INIT_CALL)
    assert not m.matches(_stmt("self.x = super().__init__\n"), SUPER_INIT_CALL)


def test_self_attributes_and_activation_entries():
    assert m.matches(cst.parse_expression("self . gate"), self_attr("gate"))
    assert not m.matches(cst.parse_expression("self.mlp.gate"), self_attr("gate"))
    assert not m.matches(cst.parse_expression("other.gate"), self_attr("gate"))
    assert m.matches(cst.parse_expression("ACT2FN[config.hidden_act]"), ACT2FN_ENTRY)
    assert not m.matches(cst.parse_expression("nn.SiLU()"), ACT2FN_ENTRY)


def test_same_compares_trees_not_names():
    a, b = cst.parse_expression("config.hidden_size"), cst.parse_expression("config.hidden_size")
    assert same(a, b) and same(None, None)
    assert not same(a, cst.parse_expression("config.intermediate_size"))
    assert not same(a, None) and not same(None, a)
    assert same(a, b, cst.parse_expression("config.hidden_size"))


def test_torch_modules_built_are_found_by_structure():
    linear = cst.parse_expression("nn.Linear(\n    config.hidden_size,  # in\n    config.vocab_size,\n)")
    assert builds(linear, nn_call("Linear"))
    assert not builds(linear, nn_call("Embedding"))
    assert not builds(cst.parse_expression("MyLinear(4, 4)"), nn_call("Linear"))
    assert not builds(None, nn_call("Linear"))  # nothing was assigned
