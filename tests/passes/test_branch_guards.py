"""``cst_tools.branch_guards``: the guards a pass emits for the config switches it drops."""

from hfrewrite.emit import cst_tools as t

INIT = {"config": "config", "norm_topk": "config.norm_topk", "norm_topk_prob": "config.norm_topk_prob"}


def test_a_guard_is_skipped_only_for_the_carried_condition_itself():
    branches = (("self.norm_topk", True), ("self.norm_topk_prob", True))
    out = t.branch_guards(branches, INIT, "Router", "router", skip="config.norm_topk_prob")
    # a name that is a prefix of the carried one is another switch: its guard stays
    assert out == (
        "if not (config.norm_topk):\n"
        '    raise NotImplementedError("hfrewrite: Router was converted for configs where '
        '`config.norm_topk` is True: its router takes another branch here")\n'
    )


def test_an_operand_of_a_carried_conjunction_is_carried():
    branches = (("self.norm_topk_prob", True), ("self.config.x > 1", False))
    out = t.branch_guards(branches, INIT, "R", "router", skip="config.norm_topk_prob and config.y")
    assert "norm_topk_prob" not in out and "if (config.x > 1):" in out
