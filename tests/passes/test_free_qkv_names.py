"""fuse_qkv's split binds q, k and v: a forward already using those names has them freed
first (emit/fused_projection.free_qkv_names), its locals and its positional parameters
(CTRL's ``forward(self, v, k, q, ...)``, called by position); a keyword-only one stays a
refusal, since its callers name it."""

import libcst as cst
import pytest

from hfrewrite.emit.fused_projection import free_qkv_names
from hfrewrite.errors import HfrewriteError


def _forward(src: str) -> cst.FunctionDef:
    return cst.parse_module(src).body[0]


def test_positional_parameters_named_q_k_v_are_renamed_with_their_reads():
    before = (
        "def forward(self, v, k, q, layer_past=None):\n"
        "    shape = q.shape[:-1]\n"
        "    return self.Wq(q), self.Wk(k), self.Wv(v, k=1)\n"
    )
    after = (
        "def forward(self, v_states, k_states, q_states, layer_past=None):\n"
        "    shape = q_states.shape[:-1]\n"
        "    return self.Wq(q_states), self.Wk(k_states), self.Wv(v_states, k=1)\n"
    )
    assert cst.Module(body=[free_qkv_names(_forward(before), "MultiHeadAttention")]).code == after


def test_locals_are_renamed_and_other_names_kept():
    before = "def forward(self, x):\n    q = self.q(x)\n    return q + x\n"
    after = "def forward(self, x):\n    q_states = self.q(x)\n    return q_states + x\n"
    assert cst.Module(body=[free_qkv_names(_forward(before), "A")]).code == after


def test_a_keyword_only_parameter_named_q_is_refused():
    with pytest.raises(HfrewriteError, match="forward already uses the names q"):
        free_qkv_names(_forward("def forward(self, x, *, q):\n    return self.p(x) + q\n"), "A")


def test_a_freed_name_already_taken_is_refused():
    src = "def forward(self, x):\n    q = self.q(x)\n    q_states = q * 2\n    return q_states\n"
    with pytest.raises(HfrewriteError, match="forward already uses the names q"):
        free_qkv_names(_forward(src), "A")
