"""Routing beyond softmax top-k (analyze/routing.py): DeepSeek-style grouped sigmoid routing
with a score-correction bias and a scaling factor, and router mutations that must convert
to what they compute or be refused, never converted wrong."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.glm4_moe import modeling_glm4_moe as gm
from transformers.models.qwen3_moe import modeling_qwen3_moe as qm

from hfrewrite.analyze.model import analyze
from hfrewrite.errors import HfrewriteError


def moe_plan(model_type="glm4_moe", **overrides):
    return analyze(transformers.AutoConfig.for_model(model_type, **overrides)).moe


@pytest.mark.parametrize("model_type", ["glm4_moe", "dots1"])
def test_grouped_sigmoid_routing_facts(model_type):
    moe = moe_plan(model_type)
    assert (moe.scoring, moe.correction_bias, moe.n_group, moe.topk_group) == (
        "sigmoid", "e_score_correction_bias", 4, 2)
    assert (moe.top_k, moe.renormalize, moe.routed_scaling_factor, moe.router_fp32) == (3, True, 2.5, True)
    assert dict(moe.config_attrs) == {"n_group": "gate.num_group", "topk_group": "gate.topk_group",
                                      "routed_scaling_factor": "gate.routed_scaling_factor"}
    assert (moe.shared_expert, moe.shared_expert_gate) == ("shared_experts", None)
    assert moe.grouped
    assert moe.describe_routing() == ("F.linear (float32) -> sigmoid -> + e_score_correction_bias (choice only) "
                                     "-> top-2 of 4 groups -> top-3 -> renormalize=True -> x 2.5")


def test_softmax_top_k_stays_off_the_grouped_path():
    moe = moe_plan("qwen3_moe")
    assert not moe.grouped and moe.config_attrs == () and moe.correction_bias is None


def _route(self, hidden_states, *, scoring="sigmoid", bias_in_weights=False, renormalize=True, scale=True,
           scale_before_renormalize=False):
    """Glm4MoeTopkRouter.forward with one step changed."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    logits = F.linear(hidden_states.float(), self.weight.float())
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores + self.e_score_correction_bias
    group_scores = choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    mask = group_mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group)
    choice = choice.masked_fill(~mask.reshape(-1, self.num_experts).bool(), float("-inf"))
    idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
    weights = (scores + self.e_score_correction_bias if bias_in_weights else scores).gather(1, idx)
    if scale and scale_before_renormalize:
        weights = weights * self.routed_scaling_factor
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scale and not scale_before_renormalize:
        weights = weights * self.routed_scaling_factor
    return logits, weights, idx


CONVERTED = {  # mutation -> the facts it converts to
    "as in the source": ({}, {"scoring": "sigmoid", "renormalize": True, "routed_scaling_factor": 2.5}),
    "softmax scoring": ({"scoring": "softmax"}, {"scoring": "softmax", "renormalize": True}),
    "no renormalisation": ({"renormalize": False}, {"renormalize": False, "routed_scaling_factor": 2.5}),
    "no scaling factor": ({"scale": False}, {"renormalize": True, "routed_scaling_factor": 1.0}),
}
REFUSED = {
    "correction bias kept in the weights": {"bias_in_weights": True},
    "scaled before renormalising": {"scale_before_renormalize": True},
}


@pytest.mark.parametrize("case", list(CONVERTED))
def test_router_mutations_convert_to_what_they_compute(monkeypatch, case):
    change, facts = CONVERTED[case]
    monkeypatch.setattr(gm.Glm4MoeTopkRouter, "forward", lambda self, x: _route(self, x, **change))
    moe = moe_plan()
    assert {k: getattr(moe, k) for k in facts} == facts


@pytest.mark.parametrize("case", list(REFUSED))
def test_router_mutations_vllm_cannot_express_are_refused(monkeypatch, case):
    monkeypatch.setattr(gm.Glm4MoeTopkRouter, "forward", lambda self, x: _route(self, x, **REFUSED[case]))
    with pytest.raises(HfrewriteError, match="Glm4MoeMoE: fuse_experts: replaying the plan"):
        moe_plan()


def test_a_correction_bias_outside_the_router_is_refused(monkeypatch):
    monkeypatch.setattr(gm.Glm4MoeMoE, "forward", _block_with_own_bias)
    with pytest.raises(HfrewriteError, match="routing reads"):
        moe_plan()


def _block_with_own_bias(self, hidden_states):
    """Routing that reads a per-expert tensor the block (not its router) holds."""
    if not hasattr(self, "offset"):
        self.register_buffer("offset", torch.zeros(self.gate.num_experts))
    orig_shape = hidden_states.shape
    x = hidden_states.view(-1, orig_shape[-1])
    scores = F.linear(x, self.gate.weight).sigmoid() + self.offset
    weights, idx = torch.topk(scores, self.gate.top_k, dim=-1)
    return (self.experts(x, idx, weights) + self.shared_experts(x)).view(*orig_shape)


def _qwen_router(linear_input, bias_name=None):
    """Qwen3MoeTopKRouter.forward with its projection's input and bias changed."""

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        bias = None
        if bias_name:
            if not hasattr(self, bias_name):
                self.register_parameter(bias_name, torch.nn.Parameter(torch.zeros(self.num_experts)))
            bias = getattr(self, bias_name)
        logits = F.linear(linear_input(hidden_states), self.weight, bias)
        top, idx = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), idx

    return forward


def test_a_router_reading_another_input_than_the_experts_is_refused(monkeypatch):
    monkeypatch.setattr(qm.Qwen3MoeTopKRouter, "forward", _qwen_router(lambda h: h * 2))
    with pytest.raises(HfrewriteError, match="router and experts read different inputs"):
        moe_plan("qwen3_moe")


def test_a_router_bias_that_is_not_its_own_bias_parameter_is_refused(monkeypatch):
    monkeypatch.setattr(qm.Qwen3MoeTopKRouter, "forward", _qwen_router(lambda h: h, bias_name="b"))
    with pytest.raises(HfrewriteError, match="the router's bias is gate.b, not the router's own bias parameter"):
        moe_plan("qwen3_moe")


def test_a_router_weight_computed_in_the_forward_is_refused(monkeypatch):
    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight * 1.5)
        top, idx = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        return logits, top, idx

    monkeypatch.setattr(qm.Qwen3MoeTopKRouter, "forward", forward)
    with pytest.raises(HfrewriteError, match="router weight is not a module parameter"):
        moe_plan("qwen3_moe")
