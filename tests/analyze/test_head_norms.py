"""q/k norms with weights of their own per head: found on values, proven to normalise each
head apart, and proven on a sibling config where the traced config switches them off."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from hfrewrite.analyze.head_norms import own_weights_per_head
from hfrewrite.analyze.leaf_modules import is_leaf, is_norm_list
from hfrewrite.analyze.model import analyze
from hfrewrite.analyze.plan import Refusal


def plan_of(model_type: str, **overrides):
    return analyze(transformers.AutoConfig.for_model(model_type, **overrides))


class PerHeadLayerNorm(nn.Module):
    """StableLM-2's form: one LayerNorm per head, split on the heads' axis."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm(dim) for _ in range(heads)])

    def forward(self, x):
        parts = torch.split(x, 1, dim=1)
        return torch.cat([norm(part) for norm, part in zip(self.norms, parts)], dim=1)


class HeadWeightNorm(nn.Module):
    """Command R+'s form: one norm whose weight is [heads, head_dim]."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, dim))

    def forward(self, x):
        return nn.functional.layer_norm(x, x.shape[-1:]) * self.weight


class AcrossHeadsNorm(nn.Module):
    """Normalises over heads and lanes together: a rank with some heads cannot compute it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return nn.functional.layer_norm(x, x.shape[-2:]) * self.weight


def test_a_container_of_norms_is_traced_as_one_leaf():
    per_head = PerHeadLayerNorm(8, 4)
    assert is_norm_list(per_head) and is_leaf(per_head)
    assert not is_norm_list(nn.ModuleList([nn.LayerNorm(8)]))  # the list itself is no call
    holder = PerHeadLayerNorm(8, 2)
    holder.scale = nn.Parameter(torch.ones(1))  # a tensor of its own: it computes more
    assert not is_norm_list(holder)
    mixed = PerHeadLayerNorm(8, 2)
    mixed.proj = nn.Linear(8, 8)
    assert not is_norm_list(mixed)


@pytest.mark.parametrize("norm", [PerHeadLayerNorm(16, 4), HeadWeightNorm(16, 4)])
def test_weights_per_head_are_found_even_when_a_fresh_model_holds_ones(norm):
    # a fresh model's weights are ones, equal across heads: the proof randomises them
    assert own_weights_per_head({"q": norm, "k": norm}, {"q": (4, 16), "k": (4, 16)})


def test_a_norm_shared_by_every_head_needs_no_placing():
    shared = nn.LayerNorm(16)
    assert not own_weights_per_head({"q": shared, "k": shared}, {"q": (4, 16), "k": (2, 16)})


def test_a_norm_across_heads_is_refused():
    with pytest.raises(Refusal, match="does not normalise each head apart"):
        own_weights_per_head({"q": AcrossHeadsNorm(16), "k": nn.LayerNorm(16)}, {"q": (4, 16), "k": (2, 16)})


def test_stablelm_per_head_layernorms_traced_on():
    att = plan_of("stablelm", qk_layernorm=True, use_parallel_residual=True).attention
    assert (att.q_norm, att.k_norm, att.qk_norm_over) == ("q_layernorm", "k_layernorm", "each_head")


def test_stablelm_default_config_proves_the_norms_on_a_sibling():
    # qk_layernorm is off in the default config: the norms come from a sibling config that
    # turns it on, validated at convert time beside the converted config
    plan = plan_of("stablelm")
    assert (plan.attention.q_norm, plan.attention.qk_norm_over) == ("q_layernorm", "each_head")
    siblings = [(what, config.qk_layernorm) for what, config in plan.sibling_configs]
    assert siblings == [("q/k norms (qk_layernorm true)", True)]


def test_cohere_head_weight_norms_proven_on_a_sibling():
    plan = plan_of("cohere")
    assert (plan.attention.q_norm, plan.attention.k_norm, plan.attention.qk_norm_over) == (
        "q_norm",
        "k_norm",
        "each_head",
    )
    assert [what for what, _ in plan.sibling_configs] == ["q/k norms (use_qk_norm true)"]


def test_norms_shared_by_every_head_stay_as_they_were():
    assert plan_of("persimmon").attention.qk_norm_over == "head"  # LayerNorm(head_dim)
    assert plan_of("qwen3").attention.qk_norm_over == "head"  # RMSNorm(head_dim)


@pytest.mark.parametrize("norm", [PerHeadLayerNorm(16, 4), HeadWeightNorm(16, 4)])
def test_each_rank_normalises_its_heads_in_their_places(norm):
    # the template the file carries: two ranks of two heads each equal the whole norm's slices
    from hfrewrite.templates.head_norm import norm_rank_heads

    with torch.no_grad():
        for p in norm.parameters():
            p.normal_(1.0, 0.3)
        x = torch.randn(5, 4, 16)
        whole = norm(x)
        for rank in range(2):
            part = norm_rank_heads(norm, x[:, 2 * rank : 2 * rank + 2], 4, 2 * rank)
            assert torch.allclose(part, whole[:, 2 * rank : 2 * rank + 2], atol=1e-6)
        assert torch.equal(norm_rank_heads(norm, x, 4, 0), whole)


class _Switched(nn.Module):
    """An attention-like module: its q/k norms are built, and called, only under a switch."""

    def __init__(self, config) -> None:
        super().__init__()
        self.use_norms = config.use_norms
        self.use_bias = config.use_bias
        self.proj = nn.Linear(4, 4)
        if self.use_norms:
            self.q_norm = nn.LayerNorm(4)

    def forward(self, x):
        if self.use_norms:
            x = self.q_norm(x)
        if self.use_bias:  # calls only what is built: not a norm switch
            x = self.proj(x)
        return x


def test_the_switch_flipped_is_the_one_calling_modules_the_trace_lacks():
    from types import SimpleNamespace

    from hfrewrite.analyze.qk_norm_variants import _switched_on

    config = SimpleNamespace(use_norms=False, use_bias=False)
    field, sibling = _switched_on(config, _Switched(config))
    assert (field, sibling.use_norms, sibling.use_bias, config.use_norms) == ("use_norms", True, False, False)
    on = SimpleNamespace(use_norms=True, use_bias=False)
    assert _switched_on(on, _Switched(on)) is None  # nothing left off calls an unbuilt module
