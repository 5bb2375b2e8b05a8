"""emit/router_sources.py and cst_tools.guarded_divisions: where a router renormalises, and
whether the traced config took that branch."""

from __future__ import annotations

from textwrap import dedent

import libcst as cst

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.router_sources import _traced_value

ROUTER = dedent(
    """\
    def forward(self, scores):
        if self.expert_selection_fn == "softmax":
            scores = F.softmax(scores, dim=1)
        elif self.expert_selection_fn == "sigmoid":
            scores = F.sigmoid(scores)
            if self.norm_topk_prob:
                scores = scores / torch.sum(scores, dim=-1, keepdim=True)
        else:
            scores = scores / scores.sum()
        return scores
    """
)


def _divisions() -> list[str]:
    return [c for c, _ in t.guarded_divisions(cst.parse_module(ROUTER), lambda d: True)]


def test_a_division_in_an_elif_or_else_branch_has_the_earlier_tests_negated():
    """Cohere2-MoE's renormalising division sits under `elif ... sigmoid: if norm_topk_prob:`:
    the path to it is `not softmax and sigmoid and norm_topk_prob`, not all three tests."""
    assert _divisions() == [
        (
            'not (self.expert_selection_fn == "softmax") and self.expert_selection_fn == "sigmoid" '
            "and self.norm_topk_prob"
        ),
        'not (self.expert_selection_fn == "softmax") and not (self.expert_selection_fn == "sigmoid")',
    ]


BRANCHES = (("self.expert_selection_fn == 'softmax'", True), ("self.norm_topk_prob", True))


def test_a_branch_the_traced_config_did_not_take_is_false():
    sigmoid_branch = _divisions()[0]
    assert _traced_value(sigmoid_branch, BRANCHES) is False


def test_a_branch_it_took_is_true_and_an_unknown_one_undecided():
    assert _traced_value('self.expert_selection_fn == "softmax" and self.norm_topk_prob', BRANCHES) is True
    assert _traced_value("self.norm_topk_prob and self.other", BRANCHES) is None
