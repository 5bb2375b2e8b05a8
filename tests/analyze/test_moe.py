"""MoE analysis: the facts found for the four families, and refusals that keep it closed."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.qwen3_moe import modeling_qwen3_moe as qm

from hfrewrite.analyze.model import analyze
from hfrewrite.errors import HfrewriteError


def plan(model_type, **overrides):
    return analyze(transformers.AutoConfig.for_model(model_type, **overrides))


def test_qwen3_moe_router_facts():
    p = plan("qwen3_moe", norm_topk_prob=True)
    moe = p.moe
    assert (moe.module_class, moe.router, moe.experts) == ("Qwen3MoeSparseMoeBlock", "gate", "experts")
    assert (moe.scoring, moe.renormalize, moe.top_k, moe.activation) == ("softmax", True, 2, "silu")
    assert moe.shared_expert is None and moe.checkpoint_expert_names == ("gate_proj", "down_proj", "up_proj")
    assert p.mlp.module_class == "Qwen3MoeMLP"  # traced through a dense layer of the shrunk config


def test_renormalisation_is_traced_on_whatever_the_config_says():
    # The shrunk config turns it on, so the replay proves the division the source guards
    # with `if self.norm_topk_prob`; the emitted file keeps that condition.
    assert plan("qwen3_moe", norm_topk_prob=False).moe.renormalize is True


def test_mixtral_checkpoint_layout_comes_from_transformers_conversion_table():
    moe = plan("mixtral").moe
    assert moe.renormalize is True and moe.checkpoint_expert_names == ("w1", "w2", "w3")
    assert moe.checkpoint_renames == ((".block_sparse_moe.", ".mlp."),)


def test_qwen2_moe_shared_expert_and_its_sigmoid_gate():
    p = plan("qwen2_moe")
    assert (p.moe.shared_expert, p.moe.shared_expert_gate) == ("shared_expert", "shared_expert_gate")
    assert p.mlp.module_class == "Qwen2MoeMLP"


def test_olmoe_norms_over_all_heads():
    assert plan("olmoe").attention.qk_norm_over == "all_heads"


def _refused(monkeypatch, target, attr, replacement, match):
    monkeypatch.setattr(target, attr, replacement)
    with pytest.raises(HfrewriteError, match=match):
        plan("qwen3_moe")


def test_refuses_router_with_bias(monkeypatch):
    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight, torch.ones(self.num_experts))
        probs = torch.softmax(logits, dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        return logits, top, idx

    _refused(monkeypatch, qm.Qwen3MoeTopKRouter, "forward", forward, "not the router's own bias parameter")


def test_refuses_a_scaling_factor_no_attribute_holds(monkeypatch):
    original = qm.Qwen3MoeTopKRouter.forward

    def forward(self, hidden_states):  # a literal scaling factor: no config expression to emit
        logits, scores, idx = original(self, hidden_states)
        return logits, scores * 2.5, idx

    _refused(monkeypatch, qm.Qwen3MoeTopKRouter, "forward", forward, "routed_scaling_factor 2.5 is not an attribute")


def test_refuses_interleaved_gate_up(monkeypatch):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            rows, slot = torch.where(top_k_index == e)
            h = hidden_states[rows]
            gu = F.linear(h, self.gate_up_proj[e])
            y = F.linear(self.act_fn(gu[..., ::2]) * gu[..., 1::2], self.down_proj[e])
            out.index_add_(0, rows, y * top_k_weights[rows, slot, None])
        return out

    _refused(monkeypatch, qm.Qwen3MoeExperts, "forward", forward, "replaying the plan")


def test_refuses_block_returning_a_tuple(monkeypatch):
    original = qm.Qwen3MoeSparseMoeBlock.forward

    def forward(self, hidden_states):
        out = original(self, hidden_states)
        return out, out.sum()

    def layer_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                      position_embeddings=None, **kwargs):  # the layer uses both outputs
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
            position_ids=position_ids, past_key_values=past_key_values,
            position_embeddings=position_embeddings, **kwargs)
        hidden_states = residual + hidden_states
        out, aux = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + out + 0.1 * aux

    monkeypatch.setattr(qm.Qwen3MoeSparseMoeBlock, "forward", forward)
    monkeypatch.setattr(qm.Qwen3MoeDecoderLayer, "forward", layer_forward)
    with pytest.raises(HfrewriteError, match="Qwen3MoeSparseMoeBlock: fuse_experts: the block returns more than one tensor"):
        plan("qwen3_moe")


def test_phimoe_sparsemixer_router_is_carried_and_proven_with_the_experts():
    moe = plan("phimoe").moe
    # No runner option expresses sparsemixer: the router module runs as the source has it,
    # its (weights, ids) outputs handed to the fused experts.
    assert (moe.router, moe.router_class, moe.carried_router) == ("router", "PhimoeTopKRouter", (1, 2))
    assert (moe.scoring, moe.top_k, moe.grouped) == ("carried", 2, False)
    assert moe.checkpoint_expert_names == ("w1", "w2", "w3")


def test_carried_router_still_needs_the_experts_replay(monkeypatch):
    # A block that scales the experts' output after the fused call: the router is carried,
    # but the replay of router -> experts no longer reproduces the block.
    from transformers.models.phimoe import modeling_phimoe as pm

    original = pm.PhimoeSparseMoeBlock.forward

    def forward(self, hidden_states):
        return original(self, hidden_states) * 1.5

    monkeypatch.setattr(pm.PhimoeSparseMoeBlock, "forward", forward)
    with pytest.raises(HfrewriteError, match="replaying the plan"):
        plan("phimoe")
