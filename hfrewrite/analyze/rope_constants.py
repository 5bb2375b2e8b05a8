"""The rope of a config written before transformers' ``rope_parameters``, tied to its
fields by a second analysis: what one example run cannot tell apart.

A 4.x config without a base field leaves the replay one base, 10000 at the example (the
file would write it as a constant), and a width the config holds nowhere leaves it the lanes
it saw turned (ChatGLM3 turns the first half of each head). ChatGLM3's base is in fact
``10000 * config.rope_ratio``, and ``rope_ratio`` is 1 at the example. So:

* each numeric field at 1 is set to 3 in a sibling analysis, given the rope the field would
  make (a base of 30000) and then the constant one (10000): the one the sibling proves says
  whether the base is ``10000 * config.<field>``. A field whose sibling proves neither makes
  the rope something else: refused. One whose sibling fails elsewhere (a head count at 3)
  says nothing of the rope. Each field at 10000 is set to 30000 the same way: the base is
  then ``config.<field>`` itself (OpenELM's ``rope_freq_constant``);
* a width no field holds is proven a constant share of the head on a sibling whose head size
  (the field holding it) is doubled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hfrewrite.analyze.plan import AttentionPlan, Refusal
from hfrewrite.analyze.rope import DEFAULT_THETA, LEGACY_PARTIAL, refuse_rope
from hfrewrite.analyze.rope_styles import RopeLayers


def prove_rope_constants(att, small, analyze: Callable[[dict], AttentionPlan]) -> AttentionPlan | object:
    """``att`` with the rope's base and width tied to ``small``'s fields (``small``: the
    traced config); ``analyze(edits)``: the attention plan of the sibling with ``edits`` set
    on its shrunk config (raises ``Refusal``)."""
    if (
        not isinstance(att, AttentionPlan)
        or att.rope_layers is RopeLayers.NONE
        or not att.rope_fields
        or att.rope_table
    ):
        return att  # no rope, a config with rope_parameters (the replay read them), or a base read at load
    fields = dict(att.rope_fields)
    factor = None
    if att.rotary_dim != att.head_dim and "partial_rotary_factor" not in fields and not att.rotary_dim_field:
        factor = _constant_share(att, small, analyze, float(DEFAULT_THETA))
    if fields.get("rope_theta") == DEFAULT_THETA:
        fields["rope_theta"] = _base(att, small, analyze, factor)
    if factor is not None:
        fields["partial_rotary_factor"] = repr(factor)
    return dataclasses.replace(att, rope_fields=tuple(fields.items()))


def _numeric(small) -> dict[str, float]:
    return {
        k: v
        for k, v in sorted(small.to_dict().items())
        if isinstance(v, int | float) and not isinstance(v, bool) and k not in LEGACY_PARTIAL
    }


def _proves(analyze, edits: dict) -> bool | None:
    """Whether the sibling with ``edits`` proves its rope: None where it fails elsewhere."""
    try:
        analyze(edits)
    except Refusal as e:
        return False if e.no_match.topic == "rope" else None
    return True


def _base(att: AttentionPlan, small, analyze, factor: float | None) -> str:
    """The base's expression: the constant, ``10000.0 * config.<field>`` (a field at 1 that
    scales it), or ``config.<field>`` (a field at 10000 that is it: OpenELM's
    ``rope_freq_constant``)."""
    share = {} if factor is None else {"partial_rotary_factor": factor}
    found, held = [], []
    for field, v in _numeric(small).items():
        if v not in (1, float(DEFAULT_THETA)):
            continue
        # a factor at 1 becomes 3; a base of its own at 10000 becomes 30000: either way the
        # base it makes is 30000
        edits = {field: type(v)(3 * v)}
        scaled = _proves(analyze, edits | _rope(30000.0, share))
        constant = _proves(analyze, edits | _rope(10000.0, share))
        if scaled and constant is False:
            (found if v == 1 else held).append(field)
        elif scaled is False and constant is False:
            refuse_rope(
                f"config.{field} changes the rope's base other than as its "
                f"{'factor' if v == 1 else 'value'} (at {field}={3 * v:g} the replay matches "
                "neither 30000 nor 10000)",
                att.module_class,
            )
    if len(found) + len(held) > 1:
        refuse_rope(f"the base depends on each of {found + held}", att.module_class)
    if held:
        return f"config.{held[0]}"
    return f"{DEFAULT_THETA} * config.{found[0]}" if found else DEFAULT_THETA


def _constant_share(att: AttentionPlan, small, analyze, base: float) -> float:
    """The turned share of each head, proven the same on a sibling whose head is twice as wide."""
    share = att.rotary_dim / att.head_dim
    for field, v in _numeric(small).items():
        if v != att.head_dim or not isinstance(v, int):
            continue
        try:
            other = analyze({field: 2 * v} | _rope(base, {"partial_rotary_factor": share}))
        except Refusal:
            continue
        if other.head_dim == 2 * att.head_dim and other.rotary_dim == 2 * att.rotary_dim:
            return share
    refuse_rope(
        f"the source turns the first {att.rotary_dim} of each head's {att.head_dim} "
        "lanes, a width no config field holds, and no field doubling the head size proves it a share",
        att.module_class,
    )


def _rope(theta: float, extra: dict) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta, **extra}}
