"""dbrx: experts as three flat [E * I, H] parameters, attention inside a wrapper module, a
clamp between the fused q/k/v projection and its split. Which parameter is gate, up and
down is what the replay shows, never their names: swapping them in the source moves the
roles; what the fused experts would not compute is refused."""

import inspect
import textwrap

import pytest
from transformers import AutoConfig
from transformers.models.dbrx import modeling_dbrx

from hfrewrite.analyze import model as analysis
from hfrewrite.analyze.qkv_layouts import QkvLayout
from hfrewrite.analyze.router_scorings import Scoring
from hfrewrite.errors import HfrewriteError
from hfrewrite.resolve import BARE_TYPE_FIELDS


def _analyze(**ffn):
    fields = BARE_TYPE_FIELDS["dbrx"]
    return analysis.analyze(AutoConfig.for_model("dbrx", **fields, ffn_config=ffn))


def test_dbrx_plan():
    plan = _analyze()
    moe, layer, att = plan.moe, plan.decoder_layer, plan.attention
    assert (moe.router, moe.router_linear, moe.experts) == ("router", "layer", "experts")
    assert moe.flat_experts == ("mlp.w1", "mlp.v1", "mlp.w2")
    assert moe.size_attrs == ("num_experts", "hidden_size", "ffn_hidden_size")
    assert (moe.scoring, moe.renormalize, moe.top_k_attr) == (Scoring.SOFTMAX, True, "top_k")
    assert (layer.attention_block, layer.attention_wrappers) == (
        "norm_attn_norm.attn",
        ("DbrxNormAttentionNorm",),
    )
    assert att.qkv_layout is QkvLayout.BLOCKS and att.q.attr == "Wqkv"


def _glu(gate: str, up: str, scale: float = 1.0):
    def forward(self, x, expert_w1, expert_v1, expert_w2):
        weights = {"w1": expert_w1, "v1": expert_v1}
        inter = self.activation_fn(x.matmul(weights[gate].T)) * x.matmul(weights[up].T)
        return inter.matmul(expert_w2) * scale

    return forward


def test_roles_come_from_the_replay_not_the_names(monkeypatch):
    monkeypatch.setattr(modeling_dbrx.DbrxExpertGLU, "forward", _glu("v1", "w1"))
    assert _analyze().moe.flat_experts == ("mlp.v1", "mlp.w1", "mlp.w2")


def test_experts_computing_something_else_are_refused(monkeypatch):
    monkeypatch.setattr(modeling_dbrx.DbrxExpertGLU, "forward", _glu("w1", "v1", scale=1.5))
    with pytest.raises(HfrewriteError, match="no assignment of its flat parameters"):
        _analyze()


def test_weights_divided_by_their_l2_norm_are_refused():
    # vLLM's runner renormalises by the sum (the L1 norm of positive weights) only
    with pytest.raises(HfrewriteError, match="no assignment of its flat parameters"):
        _analyze(moe_normalize_expert_weights=2.0)


def test_a_clamp_by_a_tensor_before_the_split_is_not_proven(monkeypatch):
    # bounds computed from the values: not an elementwise op with constant operands
    source = textwrap.dedent(inspect.getsource(modeling_dbrx.DbrxAttention.forward))
    old = "qkv_states.clamp(min=min_val, max=self.clip_qkv)"
    assert source.count(old) == 1
    namespace = dict(vars(modeling_dbrx))
    exec(source.replace(old, "qkv_states.clamp(min=qkv_states.mean(dim=-1, keepdim=True))"), namespace)  # noqa: S102
    monkeypatch.setattr(modeling_dbrx.DbrxAttention, "forward", namespace["forward"])
    with pytest.raises(HfrewriteError, match="fuse_qkv"):
        _analyze()
