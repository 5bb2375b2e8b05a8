"""A router's string switch (analyze/moe_variants.py): DeepSeek-V2-Lite routes greedily,
DeepSeek-V2/V2.5/Coder-V2 by groups; one file carries both, each proven on its own trace."""

import dataclasses
from pathlib import Path

import transformers

from hfrewrite.analyze.model import _analyze, analyze
from hfrewrite.analyze.moe_variants import with_other_routings
from hfrewrite.analyze.router_scorings import Scoring
from hfrewrite.analyze.shrink import shrink_config

GOLDEN = Path(__file__).resolve().parents[2] / "golden"


def _router(config, cls="DeepseekV2TopkRouter"):
    """The router module of ``config``'s model, built shrunk."""
    model = transformers.AutoModelForCausalLM.from_config(shrink_config(config))
    return next(m for m in model.modules() if type(m).__name__ == cls)


def test_both_topk_methods_are_proven_on_their_own_traces():
    plan = analyze(transformers.AutoConfig.for_model("deepseek_v2"))
    assert plan.moe.router_switch == ("self.topk_method", ("greedy", "group_limited_greedy"))
    assert plan.moe.grouped_when == "self.topk_method == 'group_limited_greedy'"
    assert ("n_group", "gate.num_group") in plan.moe.config_attrs  # from the grouped trace
    assert plan.moe.router_branches == ()  # the switch is carried, not refused
    what, sibling = plan.sibling_configs[-1]
    assert what == "topk_method 'group_limited_greedy'" and sibling.topk_method == "group_limited_greedy"
    assert isinstance(sibling.n_group, int)  # the bare config leaves it None; the branch reads it


def test_the_golden_routes_each_config_as_it_selects_and_refuses_other_strings():
    src = (GOLDEN / "deepseek_v2.py").read_text()
    assert (
        'num_expert_group=(\n                config.n_group if config.topk_method == "group_limited_greedy" else 1\n'
        in src
    )
    assert 'if config.topk_method not in ("greedy", "group_limited_greedy"):' in src


def test_a_branch_whose_plan_differs_is_not_carried():
    config = transformers.AutoConfig.for_model("deepseek_v2")
    plan = _analyze(config, branches=False).moe

    def other_scoring(sibling):  # as if the grouped branch scored by sigmoid
        return dataclasses.replace(_analyze(sibling, branches=False).moe, scoring=Scoring.SIGMOID)

    carried, declined, siblings = with_other_routings(config, plan, _router(config), other_scoring)
    assert carried.router_switch is None and carried.grouped_when is None and siblings == ()
    assert [n.reason for n in declined] == [
        "router with topk_method 'group_limited_greedy': the plan differs in scoring"
    ]
    assert carried.router_branches == (("self.topk_method == 'greedy'", True),)  # still refused


def test_a_router_without_a_string_switch_is_unchanged():
    config = transformers.AutoConfig.for_model("deepseek_v3")
    plan = _analyze(config, branches=False).moe
    router = _router(config, plan.router_class)
    assert with_other_routings(config, plan, router, lambda c: None) == (plan, (), ())
