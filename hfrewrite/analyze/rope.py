"""Rotary-embedding facts, proven by numeric replay: style and rotary dim.

The rope region of a q (or k) path is what lies between ``x``, the last value on the
path that does not depend on the positions (the head-shaped projection, after any
norm), and the attention's input. Whatever the source spells there (``rotate_half`` on
halves or on even/odd lanes, a partial slice and ``cat``, casts), the analysis replays
the candidates vLLM's ``get_rope`` can compute on the traced ``x`` and keeps the one that
reproduces the traced attention input:

* neox style (rotate the two halves) or GPT-J style (rotate even/odd pairs);
* the direction: by +theta as vLLM does, or by -theta (nanochat's ``rotate_half`` is
  ``cat(x2, -x1)``), which vLLM's rotary embedding computes with its sin table negated
  (for the default rope type, the one whose table the emitted subclass rebuilds);
* rotary dim: ``head_dim`` or ``head_dim * partial_rotary_factor`` (the rest passes);
* the frequencies of the config's ``rope_parameters`` (computed here as vLLM does for the
  default type, and with transformers' own ``ROPE_INIT_FUNCTIONS`` for scaled types,
  which vLLM implements from the same parameters).

The name of any helper (``rotate_half``) plays no part: a look-alike that interleaves is
found interleaved, one that computes something else matches no candidate.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass
from typing import NoReturn

import torch
from torch.fx import Node

from hfrewrite.analyze.plan import NoMatch, Refusal
from hfrewrite.analyze.rope_styles import RopeLayers, RopeStyle, RopeTurn
from hfrewrite.analyze.trace import value

ATOL = 1e-5


@dataclass(frozen=True)
class RopeFact:
    style: RopeStyle
    rotary_dim: int
    turn: RopeTurn = RopeTurn.FORWARD  # REVERSED: by -theta, vLLM's table with sin negated
    # a default neox rope of a base no config field holds (TeleChat's NTK alpha): the base the
    # replay read, for analyze/rope_table.py to prove on the source's own rotary module
    source_base: float | None = None
    # the per-layer config list whose entry at the layer is its base (Granite-SWA's
    # ``layer_rope_theta``), where the config's own base is not
    base_field: str | None = None


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The config's rope parameters, or those of ``layer_type`` when they are given per
    layer type (gemma3, olmo3: ``{"sliding_attention": {...}, "full_attention": {...}}``)."""
    params = getattr(config, "rope_parameters", None) or {}
    if per_layer_type(config):
        return dict(params.get(layer_type) or {})
    if not params:  # older custom configs: the fields vLLM standardises from when it loads them
        fields = legacy_rope_fields(config)
        values = {key: float(f) if f == DEFAULT_THETA else getattr(config, f) for key, f in fields}
        return values | ({"rope_type": "default"} if fields else {})
    return dict(params)


# Where configs written before transformers' rope_parameters keep the rope's base and the
# rotated fraction of each head (StableLM-epoch's rope_pct, Qwen-1's rotary_emb_base...).
LEGACY_THETA = ("rope_theta", "rotary_emb_base", "rotary_base")
LEGACY_PARTIAL = ("partial_rotary_factor", "rotary_pct", "rotary_emb_fraction", "rope_pct")


# where GPT-J-era configs keep the rotated width of each head, in lanes
ABSOLUTE_ROTARY_FIELD = "rotary_dim"

DEFAULT_THETA = "10000.0"  # a literal, not a field: the base hard-coded where the config has none


def legacy_rope_fields(config) -> tuple[tuple[str, str], ...]:
    """(rope_parameters key, config field) of a config without ``rope_parameters``: its
    base (``DEFAULT_THETA`` when it names none: the replay proves the source's constant)
    and, when it has one, its rotated fraction; () for a config that has them."""
    if getattr(config, "rope_parameters", None):
        return ()
    fields = []
    for key, names in (("rope_theta", LEGACY_THETA), ("partial_rotary_factor", LEGACY_PARTIAL)):
        found = next((n for n in names if getattr(config, n, None) is not None), None)
        if found is not None:
            fields.append((key, found))
    if not fields or fields[0][0] != "rope_theta":  # no base in the config: the source's own
        fields.insert(0, ("rope_theta", DEFAULT_THETA))  # constant, transformers' and vLLM's default
    return tuple(fields)


def _same_layout(xv, yv):
    """(x, y) with x in y's [batch, heads, seq, head_dim] layout when the rope region also
    moves the heads axis (Qwen rotates in [batch, seq, heads, head_dim], then permutes):
    the replay on the transposed x then proves both."""
    if not (torch.is_tensor(xv) and torch.is_tensor(yv) and xv.dim() == 4):
        return xv, yv
    if xv.shape == yv.shape:
        # both [batch, seq, heads, head_dim] (Llama-4 rotates, normalises, then transposes):
        # position 0, which any rope leaves as it is, lies on the second axis
        if not torch.allclose(xv[..., 0, :], yv[..., 0, :], atol=ATOL) and torch.allclose(
            xv[:, 0], yv[:, 0], atol=ATOL
        ):
            return xv.transpose(1, 2), yv.transpose(1, 2)
        return xv, yv
    if xv.transpose(1, 2).shape == yv.shape:
        return xv.transpose(1, 2), yv
    # another order (ChatGLM's [seq, batch, heads, head_dim]): the one whose position 0,
    # which any rope leaves as it is, is y's
    for order in itertools.permutations(range(4)):
        laid = xv.permute(order)
        if laid.shape == yv.shape and torch.allclose(laid[..., 0, :], yv[..., 0, :], atol=ATOL):
            return laid, yv
    return xv, yv


def _as_4d(xv, yv, seq_first: bool):
    """A rope input of three dims (batch merged with heads) in its attention input's
    [batch, heads, seq, head_dim] layout: ``seq_first``: it is [seq, batch * heads, head_dim]
    (TeleChat), else [batch * heads, seq, head_dim]."""
    if (
        torch.is_tensor(xv)
        and torch.is_tensor(yv)
        and (xv.dim(), yv.dim()) == (3, 4)
        and xv.numel() == yv.numel()
    ):
        return (xv.transpose(0, 1) if seq_first else xv).reshape(yv.shape), yv
    return xv, yv


def _both_4d(xv, yv) -> bool:
    return torch.is_tensor(xv) and torch.is_tensor(yv) and xv.shape == yv.shape and xv.dim() == 4


def per_layer_type(config) -> bool:
    params = getattr(config, "rope_parameters", None) or {}
    return "rope_theta" not in params and any(isinstance(v, dict) for v in params.values())


def _inv_freq(
    config, params: dict, layer_type: str | None, rotary_dim: int
) -> tuple[torch.Tensor, float] | None:
    kind = params.get("rope_type", "default")
    base = float(params.get("rope_theta", 10000.0))
    if kind == "dynamic" and params.get("alpha"):
        # vLLM's DynamicNTKAlphaRotaryEmbedding (Hunyuan's NTK alpha): a default rope whose
        # base is raised by alpha ** (rotary_dim / (rotary_dim - 2)), at every length
        kind, base = "default", base * float(params["alpha"]) ** (rotary_dim / (rotary_dim - 2))
    if kind == "default":
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
        return 1.0 / base**exponent, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS.get(kind)
    if init is None:
        return None
    inv_freq, scale = (
        init(config, "cpu", layer_type=layer_type) if per_layer_type(config) else init(config, "cpu")
    )
    if inv_freq.numel() * 2 != rotary_dim:
        return None
    return inv_freq.double(), float(scale)


def deepseek_yarn(params: dict, rotary_dim: int) -> tuple[torch.Tensor, float] | str:
    """(inv_freq, cos/sin scale) as vLLM 0.32's ``DeepseekScalingRotaryEmbedding`` computes
    them from ``params`` (what ``get_rope`` builds for rope_type "deepseek_yarn"), or why
    it cannot take them. Checked against vLLM's class in tests/analyze/test_rope_tables.py."""
    import math

    missing = [
        k for k in ("rope_theta", "factor", "original_max_position_embeddings") if params.get(k) is None
    ]
    if missing:
        return f"vLLM's deepseek_yarn needs {', '.join(missing)}"
    extra = {k: params[k] for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim") if k in params}
    if any(v is None for v in extra.values()):
        return f"vLLM's deepseek_yarn cannot take None for {sorted(k for k, v in extra.items() if v is None)}"
    base, factor = float(params["rope_theta"]), float(params["factor"])
    beta_fast, beta_slow = extra.get("beta_fast", 32), extra.get("beta_slow", 1)

    def mscale_of(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    def correction_dim(rotations: float) -> float:
        return (
            rotary_dim
            * math.log(params["original_max_position_embeddings"] / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rotary_dim - 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    ramp = torch.clamp(
        (torch.arange(rotary_dim // 2, dtype=torch.float) - low)
        / ((high + 0.001 if low == high else high) - low),
        0,
        1,
    )
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate (divided by factor)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    scale = mscale_of(float(extra.get("mscale", 1))) / mscale_of(float(extra.get("mscale_all_dim", 0)))
    return inv_freq.double(), float(scale)


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scale: float,
    style: RopeStyle,
    turn: RopeTurn = RopeTurn.FORWARD,
) -> torch.Tensor:
    """vLLM's rotary embedding on ``x`` [..., seq, head_dim] (rotating its first
    ``2 * len(inv_freq)`` lanes), in float64, turning as ``turn`` says (its sign on the sin table)."""
    rot = inv_freq.numel() * 2
    freqs = positions.double()[:, None] * inv_freq[None, :]  # [seq, rot/2]
    cos, sin = freqs.cos() * scale, freqs.sin() * scale * turn.sign
    xr, rest = x.double()[..., :rot], x.double()[..., rot:]
    return torch.cat((style.rotate(xr, cos, sin), rest), dim=-1)


def prove_rope(
    pairs: list[tuple[Node, Node]],
    config,
    head_dim: int,
    layer_type: str | None = None,
    layer_idx: int | None = None,
) -> RopeFact | str:
    """The one (style, rotary dim) that maps every ``(x, attention input)`` pair, or why not.

    Values are [batch, heads, seq, head_dim]; the example run's positions are 0..seq-1;
    ``layer_type``: the traced layer's entry of ``config.layer_types``; ``layer_idx``: the
    traced layer's index (its entry of a per-layer base list).
    """
    params = rope_parameters(config, layer_type)
    if not params:
        return f"no rope_parameters in the config for layer type {layer_type!r}"
    # the width get_rope(config.rope_parameters) rotates; then GPT-J's rotary_dim lanes (vLLM's
    # gpt_j.py passes their share of a head), where the config has them and no fraction
    widths = [int(head_dim * float(params.get("partial_rotary_factor", 1.0)))]
    absolute = getattr(config, ABSOLUTE_ROTARY_FIELD, None)
    if "partial_rotary_factor" not in params and isinstance(absolute, int) and 0 < absolute < head_dim:
        widths.append(absolute)
    merged = any(torch.is_tensor(value(x)) and value(x).dim() == 3 for x, _ in pairs)  # batch * heads
    shaped = False
    for seq_first in (False, True) if merged else (False,):  # TeleChat's [seq, batch * heads, d]
        values = [_same_layout(*_as_4d(value(x), value(y), seq_first)) for x, y in pairs]
        if not all(_both_4d(xv, yv) for xv, yv in values):
            continue
        shaped, positions = True, torch.arange(values[0][0].shape[2])
        turned = _turned_lanes(values)  # a width the config does not hold (ChatGLM's half)
        legacy = not getattr(config, "rope_parameters", None)  # analyze/rope_constants.py proves it
        for rotary_dim in [
            *widths,
            *([turned] if legacy and 0 < turned < head_dim and turned % 2 == 0 else []),
        ]:
            fact = _replayed(config, params, layer_type, rotary_dim, values, positions)
            if fact is not None:
                return fact
    if not shaped:
        return "the rope input and output are not both [batch, heads, seq, head_dim]"
    if (fact := _per_layer_base(config, params, layer_type, layer_idx, widths[0], values)) is not None:
        return fact
    if (base := _source_base(values, widths[0])) is not None:
        return RopeFact(style=RopeStyle.NEOX, rotary_dim=widths[0], source_base=base)
    if _inv_freq(config, params, layer_type, widths[0]) is None:
        return f"rope_type {params.get('rope_type')!r} gives no frequencies for rotary dim {widths[0]}"
    if (turned := _turned_lanes(values)) not in widths:
        return (
            f"the source turns the first {turned} of each head's {head_dim} lanes, a width no config field "
            "holds (ChatGLM's `rotary_dim // 2`): its width and base are not proven for other configs"
        )
    return (
        f"the replay matches no rope vLLM computes from rope_parameters "
        f"(neox or GPT-J style, either direction, over rotary dim {' or '.join(map(str, widths))} of {head_dim})"
    )


def per_layer_bases(config) -> list[str]:
    """Config fields holding one number per layer: candidates for each layer's rope base."""
    layers = getattr(config, "num_hidden_layers", None)
    return [
        name
        for name, items in sorted(vars(config).items())
        if isinstance(items, list) and len(items) == layers and all(type(v) in (int, float) for v in items)
    ]


def _per_layer_base(config, params: dict, layer_type, layer_idx, rotary_dim: int, values) -> RopeFact | None:
    """The rope whose base is this layer's entry of one per-layer list (the rest of the
    config's rope parameters kept), where the config's own base did not replay."""
    if layer_idx is None or per_layer_type(config):
        return None
    positions = torch.arange(values[0][0].shape[2])
    for field in per_layer_bases(config):
        base = getattr(config, field)[layer_idx]
        if not base or base == params.get("rope_theta"):
            continue
        layered = copy.copy(config)
        layered.rope_parameters = {**params, "rope_theta": float(base)}
        fact = _replayed(layered, layered.rope_parameters, layer_type, rotary_dim, values, positions)
        if fact is not None:
            return dataclasses.replace(fact, base_field=field)
    return None


def _turned_lanes(values) -> int:
    """How many leading lanes of each head the position-dependent op changes: the lanes after
    them pass every position through as they are."""
    x, y = values[0]
    same = torch.isclose(x, y, atol=ATOL).flatten(0, -2).all(dim=0)  # per lane, at every position
    changed = (~same).nonzero()
    return int(changed.max()) + 1 if len(changed) else 0


def computed_base_reason(base: float, config, layer_type: str | None = None) -> str:
    """Why a rope of a base the source computes is refused, where its table is not proven."""
    theta = float(rope_parameters(config, layer_type).get("rope_theta", 10000.0))
    return (
        f"the source turns q and k by a default rope of base {base:.0f}, not {theta:.6g} (the config's "
        "rope_theta, or the default): a base the source computes (from the head size or the length: "
        "an NTK alpha) is not proven for other configs"
    )


def _source_base(values, rotary_dim: int) -> float | None:
    """The base of the default neox rope that maps every pair, read off the angle the second
    position turns the second lane pair by, where the replay at that base proves it."""
    if values[0][0].shape[2] < 2 or rotary_dim < 4:
        return None
    xv, yv = (v.double()[..., 1, :rotary_dim] for v in values[0])  # position 1
    half = rotary_dim // 2
    x1, x2, y1, y2 = xv[..., 1], xv[..., half + 1], yv[..., 1], yv[..., half + 1]
    angle = torch.atan2(x1 * y2 - x2 * y1, x1 * y1 + x2 * y2).median().item()
    if not 0 < angle < 1:
        return None
    base = angle ** (-rotary_dim / 2)
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    positions = torch.arange(values[0][0].shape[2])
    if all(
        torch.allclose(apply_rope(xv, positions, inv_freq, 1.0, RopeStyle.NEOX), yv.double(), atol=ATOL)
        for xv, yv in values
    ):
        return base
    return None


def _replayed(config, params: dict, layer_type, rotary_dim: int, values, positions) -> RopeFact | None:
    """The style and direction whose rope over ``rotary_dim`` lanes maps every pair, if any."""
    freq = _inv_freq(config, params, layer_type, rotary_dim)
    if freq is None:
        return None
    default = params.get("rope_type", "default") == "default"
    for turn in RopeTurn if default else (RopeTurn.FORWARD,):
        for style in RopeStyle:
            if all(
                torch.allclose(apply_rope(xv, positions, *freq, style, turn), yv.double(), atol=ATOL)
                for xv, yv in values
            ):
                return RopeFact(style=style, rotary_dim=rotary_dim, turn=turn)
    return None


def rotary_field(small, attention) -> dict:
    """The config field the proven rotary width came from, when it is GPT-J's absolute one."""
    width = getattr(small, ABSOLUTE_ROTARY_FIELD, None)
    if (
        attention.rope_layers is not RopeLayers.NONE
        and attention.rotary_dim != attention.head_dim
        and width == attention.rotary_dim
    ):
        return {"rotary_dim_field": ABSOLUTE_ROTARY_FIELD}
    return {}


def refuse_rope(reason: str, module_class: str = "") -> NoReturn:
    """Refuse the attention's rotary embedding: a refusal its sibling analyses tell from the
    others by its topic (rope_constants.py), not by its wording."""
    raise Refusal(NoMatch("vllm_attention", module_class, f"rotary embedding: {reason}", topic="rope"))
