"""Routing beyond softmax top-k (analyze/routing.py): DeepSeek-style grouped sigmoid routing
with a score-correction bias and a scaling factor, and router mutations that must convert
to what they compute or be refused, never converted wrong."""

import re

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.glm4_moe import modeling_glm4_moe as gm
from transformers.models.qwen3_moe import modeling_qwen3_moe as qm

from hfrewrite.analyze.model import analyze
from hfrewrite.analyze.router_scorings import Scoring
from hfrewrite.errors import HfrewriteError


def moe_plan(model_type="glm4_moe", **overrides):
    return analyze(transformers.AutoConfig.for_model(model_type, **overrides)).moe


@pytest.mark.parametrize("model_type", ["glm4_moe", "dots1"])
def test_grouped_sigmoid_routing_facts(model_type):
    moe = moe_plan(model_type)
    assert (moe.scoring, moe.correction_bias, moe.n_group, moe.topk_group) == (
        Scoring.SIGMOID,
        "gate.e_score_correction_bias",
        4,
        2,
    )
    assert (moe.top_k, moe.renormalize, moe.routed_scaling_factor, moe.router_fp32) == (
        3,
        True,
        2.5,
        True,
    )
    assert dict(moe.config_attrs) == {
        "n_group": "gate.num_group",
        "topk_group": "gate.topk_group",
        "routed_scaling_factor": "gate.routed_scaling_factor",
    }
    assert (moe.shared_expert, moe.shared_expert_gate) == ("shared_experts", None)
    assert moe.grouped
    assert moe.describe_routing() == (
        "F.linear (float32) -> sigmoid -> + gate.e_score_correction_bias (choice only) "
        "-> top-2 of 4 groups -> top-3 -> renormalize=True -> x 2.5"
    )


def test_softmax_top_k_stays_off_the_grouped_path():
    moe = moe_plan("qwen3_moe")
    assert not moe.grouped and moe.config_attrs == () and moe.correction_bias is None


# One change each to the source's Glm4MoeTopkRouter.forward ((old, new), ...): what it
# converts to, or that it is refused.
CONVERTED = {
    "as in the source": (
        (),
        {"scoring": Scoring.SIGMOID, "renormalize": True, "routed_scaling_factor": 2.5},
    ),
    "softmax scoring": (
        (
            (
                "scores = router_logits.sigmoid()",
                "scores = router_logits.softmax(dim=-1)",
            ),
        ),
        {"scoring": Scoring.SOFTMAX, "renormalize": True},
    ),
    "no renormalisation": (
        (("if self.norm_topk_prob:", "if False:"),),
        {"renormalize": False, "routed_scaling_factor": 2.5},
    ),
    "no scaling factor": (
        (("        topk_weights = topk_weights * self.routed_scaling_factor\n", ""),),
        {"renormalize": True, "routed_scaling_factor": 1.0},
    ),
}
REFUSED = {
    "correction bias kept in the weights": (
        (
            "topk_weights = scores.gather(",
            "topk_weights = (scores + self.e_score_correction_bias).gather(",
        ),
    ),
    "scaled before renormalising": (
        (
            "topk_weights = scores.gather(1, topk_indices)",
            "topk_weights = scores.gather(1, topk_indices) * self.routed_scaling_factor",
        ),
        ("        topk_weights = topk_weights * self.routed_scaling_factor\n", ""),
    ),
}


@pytest.mark.parametrize("case", list(CONVERTED))
def test_router_mutations_convert_to_what_they_compute(mutate, case):
    edits, facts = CONVERTED[case]
    mutate(gm.Glm4MoeTopkRouter, "forward", *edits)
    moe = moe_plan()
    assert {k: getattr(moe, k) for k in facts} == facts


@pytest.mark.parametrize("case", list(REFUSED))
def test_router_mutations_vllm_cannot_express_are_refused(mutate, case):
    mutate(gm.Glm4MoeTopkRouter, "forward", *REFUSED[case])
    with pytest.raises(HfrewriteError, match="Glm4MoeMoE: fuse_experts: replaying the plan") as err:
        moe_plan()
    # nor kept from the source: transformers' experts implementation is the config's choice
    assert "cannot be kept: its stacked experts run the implementation the config names" in str(err.value)


def test_a_correction_bias_the_block_holds_is_the_blocks(monkeypatch):
    """minimax_m2, hy_v3: the block holds the bias and hands it to its router."""
    monkeypatch.setattr(gm.Glm4MoeMoE, "forward", _block_with_own_bias("offset"))
    moe = moe_plan()
    assert (moe.correction_bias, moe.n_group, moe.routed_scaling_factor) == ("offset", None, 1.0)


def test_a_correction_bias_the_block_adds_to_the_weights_too_is_refused(monkeypatch):
    monkeypatch.setattr(gm.Glm4MoeMoE, "forward", _block_with_own_bias("offset", in_weights=True))
    with pytest.raises(HfrewriteError, match="replaying the plan"):
        moe_plan()


def test_a_per_expert_tensor_of_another_child_is_refused(monkeypatch):
    monkeypatch.setattr(gm.Glm4MoeMoE, "forward", _block_with_own_bias("shared_experts.offset"))
    with pytest.raises(HfrewriteError, match="routing reads shared_experts.offset"):
        moe_plan()


def _block_with_own_bias(where: str, in_weights: bool = False):
    """Sigmoid routing whose choice reads a per-expert tensor held at ``where`` (in the
    block); the weights are the scores (or, ``in_weights``, the biased scores)."""

    def forward(self, hidden_states):
        owner, name = self.get_submodule(where.rpartition(".")[0]), where.rpartition(".")[2]
        if not hasattr(owner, name):
            owner.register_buffer(name, torch.randn(self.gate.num_experts) * 0.1)
        orig_shape = hidden_states.shape
        x = hidden_states.view(-1, orig_shape[-1])
        scores = F.linear(x, self.gate.weight).sigmoid()
        choice = scores + getattr(owner, name)
        idx = torch.topk(choice, self.gate.top_k, dim=-1)[1]
        weights = (choice if in_weights else scores).gather(1, idx)
        return (self.experts(x, idx, weights) + self.shared_experts(x)).view(*orig_shape)

    return forward


# One change each to the source's Qwen3MoeTopKRouter ((method, (old, new)), ...), and the
# reason it is refused with.
LINEAR = "F.linear(hidden_states, self.weight)"
WEIGHT = "self.weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim))"
QWEN_ROUTER_REFUSED = {
    "a bias that is no parameter": (
        [
            (
                "forward",
                (
                    LINEAR,
                    "F.linear(hidden_states, self.weight, torch.ones(self.num_experts))",
                ),
            )
        ],
        "the router's bias is not a module parameter",  # torch.ones is traced: a node, no attribute
    ),
    "a parameter other than its own bias": (
        [
            (
                "__init__",
                (
                    WEIGHT,
                    f"{WEIGHT}\n        self.b = nn.Parameter(torch.zeros(self.num_experts))",
                ),
            ),
            ("forward", (LINEAR, "F.linear(hidden_states, self.weight, self.b)")),
        ],
        "the router's bias is gate.b, not the router's own bias parameter",
    ),
    "another input than the experts'": (
        [("forward", (LINEAR, "F.linear(hidden_states * 2, self.weight)"))],
        "router and experts read different inputs",
    ),
    "a weight computed in the forward": (
        [("forward", (LINEAR, "F.linear(hidden_states, self.weight * 1.5)"))],
        "router weight is not a module parameter",
    ),
    "a literal scaling factor, no attribute's": (
        [
            (
                "forward",
                (
                    "router_scores = router_top_value\n",
                    "router_scores = router_top_value * 2.5\n",
                ),
            )
        ],
        "routed_scaling_factor 2.5 is not an attribute",
    ),
}


@pytest.mark.parametrize("case", list(QWEN_ROUTER_REFUSED))
def test_qwen_router_mutations_are_refused(mutate, case):
    edits, reason = QWEN_ROUTER_REFUSED[case]
    for method, edit in edits:
        mutate(qm.Qwen3MoeTopKRouter, method, edit)
    with pytest.raises(HfrewriteError, match=re.escape(reason)):
        moe_plan("qwen3_moe")


SCALED_OUTPUT = (
    "hidden_states = self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)",
    (
        "hidden_states = self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)"
        " * self.gate.routed_scaling_factor"
    ),
)
UNSCALED_WEIGHTS = ("        topk_weights = topk_weights * self.routed_scaling_factor\n", "")


def test_the_experts_output_scaled_by_the_block_is_the_routed_scale(mutate):
    """minimax_m3: the block, not the router, multiplies the experts' output by the factor."""
    mutate(gm.Glm4MoeTopkRouter, "forward", UNSCALED_WEIGHTS)
    mutate(gm.Glm4MoeMoE, "forward", SCALED_OUTPUT)
    moe = moe_plan()
    assert moe.routed_scaling_factor == 2.5 and moe.shared_expert == "shared_experts"
    assert dict(moe.config_attrs)["routed_scaling_factor"] == "gate.routed_scaling_factor"


def test_an_output_scaled_after_scaled_weights_is_refused(mutate):
    mutate(gm.Glm4MoeMoE, "forward", SCALED_OUTPUT)
    with pytest.raises(HfrewriteError, match="the routed output is scaled twice"):
        moe_plan()
