"""The matchers passes share (emit/shared_matchers.py) match the shapes by structure: spacing,
comments and line breaks do not matter, another shape does."""

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit.shared_matchers import QKV_PROJECTION, SUPER_INIT, TP_SIZE_LOCAL


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
