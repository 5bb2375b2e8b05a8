"""Gated delta nets (Qwen3.5's and OLMo-hybrid's linear-attention layers): the layers of a
hybrid model that mix tokens with a recurrent state updated by the delta rule, which vLLM runs
as its own ``QwenGatedDeltaNetAttention`` or ``OlmoHybridGatedDeltaNetAttention`` with a
convolution state and a recurrent state in its cache.

vLLM's layers compute ``q, k, v = conv(qkv(h))`` (a causal depthwise convolution then silu),
a gate ``z``, ``beta = sigmoid(b(h))`` (doubled by OLMo's where the config allows negative
eigenvalues) and ``g = -exp(A_log) softplus(a(h) + dt_bias)`` per value head; q and k
L2-normalised per head (q also by ``1/sqrt(dk)``) and shared by ``num_v / num_k`` value heads
each; the state ``S = exp(g) S``, then ``S += k (beta (v - S^T k))^T``, the output ``S^T q``;
then ``out(norm(o) * silu(z))``, the RMS norm over each value head. A block is replaced by it
only when replaying that formula with the block's own weights reproduces the block on values.

vLLM's classes read their sizes from the config itself (``config.linear_num_key_heads`` and so
on): each must be what the block's ``__init__`` sizes the block with, and equal on the traced
config to what its structure shows."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hfrewrite.analyze.checkpoint import concatenated_sources
from hfrewrite.analyze.mamba2 import init_expressions
from hfrewrite.analyze.mixer_replay import replay_difference
from hfrewrite.analyze.plan import GatedDeltaNetPlan, NoMatch

PATTERN = "gated_delta_net"


@dataclass(frozen=True)
class Layout:
    """How a block's checkpoint holds the gated delta net's parts, and the vLLM class
    taking that layout."""

    name: str  # GatedDeltaNetPlan.layout
    # projections whose outputs are (q, k, v), z, b and a, in this order
    projections: tuple[str, ...]
    norm: str
    out: str
    # the norm's epsilon vLLM's class uses whatever the config says (None: rms_norm_eps)
    fixed_norm_eps: float | None = None


# Qwen3.5's four projections apart, which vLLM's layer loads into its in_proj_qkvz and
# in_proj_ba; Qwen3-Next's two, interleaved per key head, loaded as they are; OLMo-hybrid's
# six apart (q, k, v and the gate g loaded into in_proj_qkvg)
LAYOUTS = (
    Layout("separate", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), "norm", "out_proj"),
    Layout("interleaved", ("in_proj_qkvz", "in_proj_ba"), "norm", "out_proj"),
    Layout("olmo", ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj"), "o_norm", "o_proj", 1e-5),
)
_LAYOUT = {x.name: x for x in LAYOUTS}
PARAMETERS = ("A_log", "dt_bias")
NOT_A_GDN = (
    "not a gated delta net ("
    + "; or ".join(", ".join((*x.projections, "conv1d", x.norm, x.out, *PARAMETERS)) for x in LAYOUTS)
    + ")"
)
_TOKENS = 7  # longer than the convolution, so that its window and the recurrence are exercised
_ACTIVATIONS = ("silu", "swish")  # what vLLM's convolution and its gate apply here
# what vLLM's classes read of the config -> the size of the block it must equal
_READ = (
    "hidden_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "rms_norm_eps",
)
_GATE = 'getattr(config, "output_gate_type", "silu")'
# OLMo's: beta doubled where the config allows negative eigenvalues (vLLM reads it so)
_NEG_EIGVAL = 'getattr(config, "linear_allow_neg_eigval", False)'


def analyze_gated_delta_net(layer: nn.Module, attr: str, config) -> GatedDeltaNetPlan | NoMatch:
    """The plan of the block ``layer.<attr>`` when it is vLLM's gated delta net on ``config``
    (the traced config), else why not."""
    module = layer.get_submodule(attr)
    name = type(module).__name__
    weighted = {n for n, m in module.named_children() if any(True for _ in m.parameters())}
    params = {n for n, _ in module.named_parameters(recurse=False)}
    layouts = [x for x in LAYOUTS if weighted == {*x.projections, "conv1d", x.norm, x.out}]
    if len(layouts) != 1 or params != set(PARAMETERS):
        return NoMatch(PATTERN, name, NOT_A_GDN)
    layout = layouts[0]
    sizes = _sizes(module, layout)
    if isinstance(sizes, str):
        return NoMatch(PATTERN, name, sizes)
    read = _read_from_config(type(module), config, sizes, layout)
    if isinstance(read, str):
        return NoMatch(PATTERN, name, read)
    activation = getattr(config, "hidden_act", None)
    gate = "silu" if layout.name == "olmo" else getattr(config, "output_gate_type", "silu")
    if activation not in _ACTIVATIONS or gate not in _ACTIVATIONS:
        return NoMatch(
            PATTERN, name, f"config.hidden_act ({activation!r}) or its gate ({gate!r}) is not silu"
        )
    neg_eigval = layout.name == "olmo" and bool(getattr(config, "linear_allow_neg_eigval", False))
    failed = _replay_fails(module, read, layout, neg_eigval)
    if failed:
        return NoMatch(PATTERN, name, failed)
    why = "vLLM's gated delta net applies silu in its convolution and its gate, as the traced block does"
    fixed = [(f"config.hidden_act in {_ACTIVATIONS!r}".replace("'", '"'), why)]
    if layout.name != "olmo":
        fixed.append((f"{_GATE} in {_ACTIVATIONS!r}".replace("'", '"'), why))
    elif _other_eigval_fails(module, config, read, layout, neg_eigval):
        fixed.append(
            (f"bool({_NEG_EIGVAL}) is {neg_eigval}", "the traced block was proven with this value alone")
        )
    return GatedDeltaNetPlan(
        module_class=name,
        attr=attr,
        interleaved=layout.name == "interleaved",
        layout=layout.name,
        fixed=tuple(fixed),
        conv_sources=concatenated_sources(config.model_type, f"{attr}.conv1d.weight")
        if layout.name == "olmo"
        else (),
    )


def _replay_fails(module: nn.Module, sizes: dict, layout: Layout, neg_eigval: bool) -> str:
    """Why replaying vLLM's formula does not give the block ("" where it does)."""
    difference = replay_difference(
        module,
        sizes["hidden_size"],
        _TOKENS,
        lambda hidden: reference(module, hidden, sizes, layout.name, 2.0 if neg_eigval else 1.0),
    )
    if difference is None or difference > 1e-4:
        shown = "fails" if difference is None else f"differs by {difference:.2e}"
        return f"replaying vLLM's gated delta net {shown}"
    return ""


def _other_eigval_fails(module: nn.Module, config, sizes: dict, layout: Layout, neg_eigval: bool) -> bool:
    """Whether the block, with the attributes its ``__init__`` sets from
    ``config.linear_allow_neg_eigval`` given the other value, is not vLLM's formula for that
    value (True also where its ``__init__`` reads no such attribute)."""
    attrs = [
        attr
        for attr, code, _ in init_expressions(type(module), config)
        if code == "config.linear_allow_neg_eigval"
    ]
    if not attrs:
        return True
    twin = copy.deepcopy(module)
    for attr in attrs:
        setattr(twin, attr, not neg_eigval)
    return bool(_replay_fails(twin, sizes, layout, not neg_eigval))


def _sizes(module: nn.Module, layout: Layout) -> dict | str:
    """The block's sizes as its structure shows them (a str: why it is not one)."""
    linears = [module.get_submodule(n) for n in (*layout.projections, layout.out)]
    conv, out, norm = module.conv1d, linears[-1], module.get_submodule(layout.norm)
    if not (type(conv) is nn.Conv1d and all(type(x) is nn.Linear for x in linears)):
        return "its conv1d and projections are not a Conv1d and Linears"
    if any(x.bias is not None for x in linears):
        return "its projections have biases, which vLLM's gated delta net has not"
    channels, heads = conv.in_channels, module.A_log.numel()
    head_v = norm.weight.numel()
    value_dim = heads * head_v
    key_dim = (channels - value_dim) // 2
    # q, k, v then z; b then a: one projection of each pair, or one each
    widths = {
        "separate": [channels, value_dim, heads, heads],
        "interleaved": [channels + value_dim, 2 * heads],
        "olmo": [key_dim, key_dim, value_dim, value_dim, heads, heads],
    }[layout.name]
    if [x.out_features for x in linears[:-1]] != widths or len({x.in_features for x in linears[:-1]}) != 1:
        return f"its projections are not q, k, v ({channels}), z ({value_dim}), b and a ({heads} each) of one input"
    if not (conv.groups == channels == conv.out_channels and conv.bias is None):
        return f"conv1d is not a depthwise convolution without bias over its {channels} q, k, v channels"
    if conv.stride != (1,) or conv.dilation != (1,):
        return "conv1d is strided or dilated"
    if module.dt_bias.numel() != heads or out.in_features != value_dim or (channels - value_dim) % 2:
        return f"dt_bias and out_proj are not {heads} value heads of {head_v} (the norm's width)"
    eps = [v for v in vars(norm).values() if type(v) is float]
    if len(eps) != 1:
        return "its norm keeps no one epsilon"
    if layout.fixed_norm_eps is not None and eps[0] != layout.fixed_norm_eps:
        return f"its norm's epsilon is {eps[0]!r}, where vLLM's layer takes {layout.fixed_norm_eps!r}"
    return {
        "hidden_size": out.out_features,
        "linear_num_value_heads": heads,
        "linear_value_head_dim": head_v,
        "key_dim": key_dim,
        "linear_conv_kernel_dim": conv.kernel_size[0],
        "rms_norm_eps": eps[0],
    }


def _read_from_config(cls: type, config, sizes: dict, layout: Layout) -> dict | str:
    """``sizes`` with the key heads and their width, after proving that each config attribute
    vLLM's class reads is one the block's ``__init__`` is built from and, on ``config``, what
    its structure shows (a str: why not)."""
    built_from = {code for _, code, _ in init_expressions(cls, config)}
    # (vLLM's OLMo layer takes its norm's epsilon as a constant, checked above)
    read = _READ if layout.fixed_norm_eps is None else _READ[:-1]
    for attr in read:
        if f"config.{attr}" not in built_from:
            return f"its __init__ does not read config.{attr}, which vLLM's gated delta net is sized by"
    got = {attr: getattr(config, attr) for attr in read}
    heads, width = got["linear_num_key_heads"], got["linear_key_head_dim"]
    if heads * width != sizes["key_dim"] or got["linear_num_value_heads"] % heads:
        return f"config.linear_num_key_heads ({heads}) by linear_key_head_dim ({width}) is not its key width"
    for attr, want in sizes.items():
        if attr in got and got[attr] != want:
            return f"config.{attr} is {got[attr]!r} where the traced block has {want!r}"
    return {**sizes, "linear_num_key_heads": heads, "linear_key_head_dim": width}


def _projected(module: nn.Module, hidden: torch.Tensor, sizes: dict, layout: str) -> tuple:
    """(q, k, v as the convolution reads them, z, b, a) of ``hidden``; Qwen3-Next's two
    projections taken apart per key head as vLLM's layer does (``[q k v z]`` and ``[b a]``
    per key head, the value heads of a key head consecutive)."""
    if layout != "interleaved":
        parts = [module.get_submodule(n)(hidden) for n in _LAYOUT[layout].projections]
        return (torch.cat(parts[:3], dim=-1), *parts[3:]) if layout == "olmo" else tuple(parts)
    heads_k, heads_v = sizes["linear_num_key_heads"], sizes["linear_num_value_heads"]
    dk, dv, per = sizes["linear_key_head_dim"], sizes["linear_value_head_dim"], heads_v // heads_k
    batch, tokens, _ = hidden.shape
    qkvz = module.in_proj_qkvz(hidden).reshape(batch, tokens, heads_k, -1)
    ba = module.in_proj_ba(hidden).reshape(batch, tokens, heads_k, 2 * per)
    parts = (*qkvz.split([dk, dk, per * dv, per * dv], dim=-1), *ba.split([per, per], dim=-1))
    q, k, v, z, b, a = (x.reshape(batch, tokens, -1) for x in parts)
    return torch.cat((q, k, v), dim=-1), z, b, a


def reference(
    module: nn.Module, hidden: torch.Tensor, sizes: dict, layout: str = "separate", beta_scale: float = 1.0
) -> torch.Tensor:
    """vLLM's gated delta net of ``hidden`` [batch, tokens, hidden] from a zero state, with
    the block's weights and ``sizes``, the recurrence taken token by token in float32."""
    heads_k, heads_v = sizes["linear_num_key_heads"], sizes["linear_num_value_heads"]
    dk, dv, kernel = (
        sizes["linear_key_head_dim"],
        sizes["linear_value_head_dim"],
        sizes["linear_conv_kernel_dim"],
    )
    batch, tokens, _ = hidden.shape
    qkv, z, b, a = _projected(module, hidden, sizes, layout)
    qkv = qkv.transpose(1, 2)
    qkv = F.silu(F.conv1d(F.pad(qkv, (kernel - 1, 0)), module.conv1d.weight, groups=qkv.shape[1]))
    q, k, v = qkv.transpose(1, 2).float().split([heads_k * dk, heads_k * dk, heads_v * dv], dim=-1)
    q, k = (_l2norm(x.reshape(batch, tokens, heads_k, dk)) for x in (q, k))
    q, k = (x.repeat_interleave(heads_v // heads_k, dim=2) for x in (q * dk**-0.5, k))
    v = v.reshape(batch, tokens, heads_v, dv)
    beta = torch.sigmoid(b.float()) * beta_scale
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias.float())
    state = hidden.new_zeros(batch, heads_v, dk, dv, dtype=torch.float32)
    out = []
    for i in range(tokens):
        state = state * g[:, i].exp()[..., None, None]
        delta = (v[:, i] - (state * k[:, i, ..., None]).sum(-2)) * beta[:, i, :, None]
        state = state + k[:, i, ..., None] * delta[..., None, :]
        out.append((state * q[:, i, ..., None]).sum(-2))
    o = torch.stack(out, dim=1)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + sizes["rms_norm_eps"])
    z = z.float().reshape(batch, tokens, heads_v, dv)
    norm = module.get_submodule(_LAYOUT[layout].norm)
    o = (norm.weight.float() * o * F.silu(z)).reshape(batch, tokens, heads_v * dv)
    return module.get_submodule(_LAYOUT[layout].out)(o.to(hidden.dtype))


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """Each head's vector over its L2 norm, as vLLM's kernels take it (epsilon 1e-6 inside)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)
