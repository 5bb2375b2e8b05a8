"""The other branches of multi-head latent attention, proven so that one file serves every
released config of its type.

Released DeepSeek checkpoints differ in exactly the switches MLA branches on: a low-rank
query or none (``q_lora_rank: null`` in DeepSeek-V2-Lite and Moonlight) and the rope (YaRN
in every V2/V3/R1 release, none in the bare config). The analysis traced one config; here
the same type is traced again on a sibling config that takes the other branch of each
switch, and the MLA analysis runs on it as on the first. A branch is carried by the file
only when its plan agrees with the first on everything else (heads, sizes, rope style,
roles of the kv projections); else the file keeps refusing such configs, with the reason in
``--explain``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

from hfrewrite.analyze.plan import MlaPlan, NoMatch, Refusal
from hfrewrite.analyze.shrink import INVALID_FIELD

PATTERN = "mla_attention"
# A YaRN rope as DeepSeek releases it (V2-Lite: mscale 0.707 on both; here the two differ so
# that the ratio vLLM puts on cos/sin is not 1).
YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
}
LOW_RANK_QUERY = 1536  # DeepSeek-V3's q_lora_rank (shrunk like the rest)
# Fields that may differ between the plans of two branches; all others must agree.
_BRANCH_FIELDS = (
    "q_a",
    "q_a_norm",
    "q_b",
    "q_lora_rank",
    "rope_kind",
    "dims",
    "none_attrs",
    "config_branches",
)


def with_other_branches(
    config, plan: MlaPlan, analyze: Callable[[object], object]
) -> tuple[MlaPlan, tuple[NoMatch, ...], tuple[tuple[str, object], ...]]:
    """``plan`` extended by the branches proven on sibling configs (``analyze(config)`` returns
    a sibling's attention plan), what could not be proven, and the sibling configs proven
    (description, config): convert-time validation runs the file on each of them too."""
    declined: list[NoMatch] = []
    proven: list[tuple[str, object]] = []
    other_q = _sibling(config, plan, analyze, _flip_query(config, plan), declined)
    if other_q is not None:
        what, other, sibling = other_q
        switch = _switch(plan, other)
        if switch is None:
            declined.append(
                NoMatch(PATTERN, plan.module_class, "no config switch of the forward selects the query")
            )
        else:
            plan = _with_query_branch(plan, other, switch)
            proven.append((what, sibling))
    other_rope = _sibling(config, plan, analyze, _flip_rope(config, plan), declined)
    if other_rope is not None:
        what, other, sibling = other_rope
        plan = dataclasses.replace(plan, rope_kinds=(*plan.rope_kinds, other.rope_kind))
        proven.append((what, sibling))
    return plan, tuple(declined), tuple(proven)


def _sibling(config, plan: MlaPlan, analyze, flipped, declined: list[NoMatch]):
    """(description, MLA plan, config) of a sibling config whose plan agrees with ``plan``
    but for the branch fields; None (the reason in ``declined``) otherwise."""
    if flipped is None:
        return None
    what, sibling_config = flipped
    try:
        other = analyze(sibling_config)
    except Refusal as refusal:
        other = refusal.no_match
    if not isinstance(other, MlaPlan):
        reason = (
            other.reason if isinstance(other, NoMatch) else f"not multi-head latent attention ({type(other)})"
        )
        declined.append(NoMatch(PATTERN, plan.module_class, f"{what}: not proven ({reason})"))
        return None
    fixed = (
        {f.name for f in dataclasses.fields(MlaPlan)}
        - set(_BRANCH_FIELDS)
        - {"rope_kinds", "q_switch", "q_other"}
    )
    if any(getattr(other, f) != getattr(plan, f) for f in fixed if f != "scaling"):
        differ = sorted(f for f in fixed if f != "scaling" and getattr(other, f) != getattr(plan, f))
        declined.append(
            NoMatch(PATTERN, plan.module_class, f"{what}: the plan differs in {', '.join(differ)}")
        )
        return None
    return what, other, sibling_config


def _flip_query(config, plan: MlaPlan):
    """The config with the other kind of query: no low-rank query, or one."""
    if not hasattr(config, "q_lora_rank"):
        return None
    sibling = copy.deepcopy(config)
    rank = None if plan.q_a is not None else LOW_RANK_QUERY
    try:
        sibling.q_lora_rank = rank
    except INVALID_FIELD:  # a config typed to always have one (A.X-K1 validates an int): no other kind
        return None
    if rank is None:
        return "no low-rank query (q_lora_rank None)", sibling
    return f"a low-rank query (q_lora_rank {LOW_RANK_QUERY})", sibling


def _flip_rope(config, plan: MlaPlan):
    """The config with the other proven rope: YaRN for a default rope, and back."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in params or plan.rope_kind not in ("default", "deepseek_yarn"):
        return None
    sibling = copy.deepcopy(config)
    if plan.rope_kind == "default":
        sibling.rope_parameters = {"rope_theta": params["rope_theta"], **YARN}
        return "a YaRN rope", sibling
    sibling.rope_parameters = {"rope_type": "default", "rope_theta": params["rope_theta"]}
    return "the default rope", sibling


def _switch(plan: MlaPlan, other: MlaPlan) -> tuple[str, bool] | None:
    """The forward's config test that takes the low-rank query, and its value then: the one
    test whose outcome differs between the two branches."""
    mine, theirs = dict(plan.config_branches), dict(other.config_branches)
    flipped = [test for test in mine if test in theirs and mine[test] != theirs[test]]
    if len(flipped) != 1:
        return None
    low_rank = plan if plan.q_a is not None else other
    return flipped[0], dict(low_rank.config_branches)[flipped[0]]


def _with_query_branch(plan: MlaPlan, other: MlaPlan, switch: tuple[str, bool]) -> MlaPlan:
    """``plan`` carrying both queries: the low-rank one's roles in ``q_a``/``q_a_norm``/``q_b``,
    the single projection in ``q_other``; the switch no longer refused."""
    low, single = (plan, other) if plan.q_a is not None else (other, plan)
    dims = dict(plan.dims) | {"q_lora_rank": low.dim("q_lora_rank")}
    return dataclasses.replace(
        plan,
        q_a=low.q_a,
        q_a_norm=low.q_a_norm,
        q_b=low.q_b,
        q_lora_rank=low.q_lora_rank,
        q_other=single.q_b,
        q_switch=switch,
        dims=tuple(dims.items()),
        none_attrs=tuple(a for a in plan.none_attrs if a in other.none_attrs),
        config_branches=tuple(b for b in plan.config_branches if b[0] != switch[0]),
    )
