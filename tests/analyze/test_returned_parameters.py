"""A parameter the attention returns beside its output for the layer to read
(GPT-NeoX-Japanese's last-layer ``dense_bias``): proven from the trace, a ``get_attr`` of the
block's own parameter; anything computed from it, or a child's parameter, is refused."""

from __future__ import annotations

import torch
import transformers
from torch import nn

from hfrewrite.analyze.attention import analyze_attention
from hfrewrite.analyze.plan import AttentionPlan, NoMatch
from hfrewrite.analyze.trace import opaque_attention, trace

CONFIG = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, head_dim=8)


class BiasApartAttention(nn.Module):
    def __init__(self, returned: str = "own"):
        super().__init__()
        self.q_proj = nn.Linear(32, 32, bias=False)
        self.k_proj = nn.Linear(32, 32, bias=False)
        self.v_proj = nn.Linear(32, 32, bias=False)
        self.dense = nn.Linear(32, 32, bias=returned == "child")
        self.dense_bias = nn.Parameter(torch.randn(32))
        self.returned = returned

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (
            p(x).view(batch, seq, -1, 8).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out, weights = opaque_attention(self, q, k, v, None, scaling=8**-0.5)
        out = self.dense(out.reshape(batch, seq, -1))
        if self.returned == "scaled":
            return out, weights, self.dense_bias * 2
        if self.returned == "child":
            return out, weights, self.dense.bias
        return out, weights, self.dense_bias


class Layer(nn.Module):
    def __init__(self, returned: str = "own"):
        super().__init__()
        self.attention = BiasApartAttention(returned)

    def forward(self, x):
        out, _, bias = self.attention(x)
        return x + out + bias


def plan_of(returned: str):
    return analyze_attention(trace(Layer(returned), (torch.randn(2, 3, 32),)), "attention", CONFIG)


def test_the_blocks_own_parameter_returned_beside_its_output_is_proven():
    plan = plan_of("own")
    assert isinstance(plan, AttentionPlan), plan
    assert plan.returned_parameters == ("dense_bias",)
    assert not plan.adds_residual


def test_a_tensor_computed_from_it_is_refused():
    plan = plan_of("scaled")
    assert isinstance(plan, NoMatch)
    assert plan.reason == "the output projection does not end the block"


def test_a_childs_parameter_is_refused():
    plan = plan_of("child")
    assert isinstance(plan, NoMatch)
    assert plan.reason == "the output projection does not end the block"
