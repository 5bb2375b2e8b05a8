"""An attention whose output is gated before its projection: the gate is proven by structure
(one product, its other operand a projection of the block's input alone) and by replaying each
row of the activation table; anything else on that path is refused with its reason."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from hfrewrite.analyze.attention import analyze_attention
from hfrewrite.analyze.output_gates import GateActivation, OutputGate
from hfrewrite.analyze.plan import NoMatch
from hfrewrite.analyze.trace import opaque_attention, trace

CONFIG = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16)


class GatedAttention(nn.Module):
    """q/k/v/o attention, its output times sigmoid(gate_proj(x)) per lane: the base edited below."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(32, 64, bias=False)
        self.k_proj = nn.Linear(32, 64, bias=False)
        self.v_proj = nn.Linear(32, 64, bias=False)
        self.gate_proj = nn.Linear(32, 64, bias=False)
        self.o_proj = nn.Linear(64, 32, bias=False)

    def forward(self, x, other):
        batch, seq, _ = x.shape
        q, k, v = (
            p(x).view(batch, seq, -1, 16).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out, _ = opaque_attention(self, q, k, v, None, scaling=0.25)
        out = out.reshape(batch, seq, -1)
        gate = torch.sigmoid(self.gate_proj(x))
        out = out * gate
        return self.o_proj(out)


def plan_of(module=None):
    module = module or GatedAttention()
    return analyze_attention(trace(module, (torch.randn(2, 3, 32), torch.randn(2, 3, 32))), "", CONFIG)


def test_a_sigmoid_gate_per_lane_is_proven():
    gate = plan_of().output_gate
    assert gate == OutputGate(
        attr="gate_proj",
        in_features=32,
        out_features=64,
        bias=False,
        activation=GateActivation.SIGMOID,
        per_head=False,
        upcast=False,
    )
    assert gate.describe() == "attention output x sigmoid(gate_proj(x)), per lane"


def test_a_softplus_gate_per_head_in_float32_is_proven(mutate):
    mutate(
        GatedAttention, "__init__", ("self.gate_proj = nn.Linear(32, 64", "self.gate_proj = nn.Linear(32, 4")
    )
    mutate(
        GatedAttention,
        "forward",
        (
            "gate = torch.sigmoid(self.gate_proj(x))",
            "gate = nn.functional.softplus(self.gate_proj(x).float())",
        ),
        (
            "out = out * gate",
            "out = (out.view(batch, seq, -1, 16) * gate.unsqueeze(-1)).view(batch, seq, -1)",
        ),
    )
    gate = plan_of().output_gate
    assert (gate.activation, gate.per_head, gate.upcast) == (GateActivation.SOFTPLUS, True, True)


def test_without_a_gate_there_is_none(mutate):
    mutate(GatedAttention, "forward", ("out = out * gate", "out = out"))
    assert plan_of().output_gate is None


# One change to GatedAttention each: (method, (old, new)), and the reason it is refused with.
REFUSALS = {
    "an activation no vLLM file applies": (
        "forward",
        ("torch.sigmoid(self.gate_proj(x))", "torch.tanh(self.gate_proj(x))"),
        "vllm_attention: replaying the output gate as sigmoid, softplus differs from the block by",
    ),
    "a gate read from another input": (
        "forward",
        ("torch.sigmoid(self.gate_proj(x))", "torch.sigmoid(self.gate_proj(other))"),
        (
            "vllm_attention: the attention output is multiplied by something other than a gate "
            "projected from the block's input"
        ),
    ),
    "a gate mixing in another tensor": (
        "forward",
        ("torch.sigmoid(self.gate_proj(x))", "torch.sigmoid(self.gate_proj(x) + other.sum())"),
        "vllm_attention: the output gate reads a tensor besides its projection of the block's input",
    ),
    "the output multiplied twice": (
        "forward",
        ("out = out * gate", "out = out * gate * gate"),
        "vllm_attention: the attention output is multiplied 2 times before its projection",
    ),
    "a gate of another width": (
        "__init__",
        ("self.gate_proj = nn.Linear(32, 64", "self.gate_proj = nn.Linear(32, 1"),
        "vllm_attention: the output gate has 1 lanes: neither one per head nor one per lane",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_other_products_are_refused(mutate, case):
    method, edit, reason = REFUSALS[case]
    mutate(GatedAttention, method, edit)
    result = plan_of()
    assert isinstance(result, NoMatch), result
    assert str(result).startswith(f"GatedAttention: {reason}"), str(result)


class PackedGateAttention(nn.Module):
    """Qwen3-Next's gated attention: q_proj projects each head's q and its gate side by side
    ([heads, 2 * head_dim], q first); the output is gated by sigmoid of the second halves."""

    def __init__(self, gate_first: bool = False, silu: bool = False):
        super().__init__()
        self.q_proj = nn.Linear(32, 128, bias=False)
        self.k_proj = nn.Linear(32, 64, bias=False)
        self.v_proj = nn.Linear(32, 64, bias=False)
        self.o_proj = nn.Linear(64, 32, bias=False)
        self.gate_first, self.silu = gate_first, silu

    def forward(self, x, other):
        batch, seq, _ = x.shape
        q, gate = torch.chunk(self.q_proj(x).view(batch, seq, -1, 32), 2, dim=-1)
        if self.gate_first:
            q, gate = gate, q
        gate = gate.reshape(batch, seq, -1)
        q = q.transpose(1, 2)
        k, v = (p(x).view(batch, seq, -1, 16).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        out, _ = opaque_attention(self, q, k, v, None, scaling=0.25)
        out = out.reshape(batch, seq, -1)
        out = out * (torch.nn.functional.silu(gate) if self.silu else torch.sigmoid(gate))
        return self.o_proj(out)


def test_a_gate_packed_beside_q_in_its_projection_is_proven():
    plan = plan_of(PackedGateAttention())
    assert (plan.num_heads, plan.head_dim, plan.q.out_features) == (4, 16, 128)
    gate = plan.output_gate
    assert gate.packed and gate.attr == "q_proj" and gate.activation is GateActivation.SIGMOID
    assert not gate.per_head


@pytest.mark.parametrize(
    ("module", "says"),
    [
        # the halves the other way round: q is not the first half of each head
        (PackedGateAttention(gate_first=True), "the q path does not split the projection into heads"),
        # a gate no row of the table replays
        (PackedGateAttention(silu=True), "replaying the output gate as sigmoid, softplus differs"),
    ],
)
def test_a_packed_q_not_proven_so_is_refused(module, says):
    plan = plan_of(module)
    assert isinstance(plan, NoMatch) and says in plan.reason, plan
