"""Gated delta nets (Qwen3.5's linear-attention layers): the layers of a hybrid model that mix
tokens with a recurrent state updated by the delta rule, which vLLM runs as its own
``QwenGatedDeltaNetAttention`` with a convolution state and a recurrent state in its cache.

vLLM's layer computes ``q, k, v = conv(in_proj_qkv(h))`` (a causal depthwise convolution then
silu), ``z = in_proj_z(h)``, ``beta = sigmoid(in_proj_b(h))`` and
``g = -exp(A_log) softplus(in_proj_a(h) + dt_bias)`` per value head; q and k L2-normalised
per head (q also by ``1/sqrt(dk)``) and shared by ``num_v / num_k`` value heads each; the
state ``S = exp(g) S``, then ``S += k (beta (v - S^T k))^T``, the output ``S^T q``; then
``out_proj(norm(o) * silu(z))``, the RMS norm over each value head. A block is replaced by it
only when replaying that formula with the block's own weights reproduces the block on values.

vLLM's class reads its sizes from the config itself (``config.linear_num_key_heads`` and so
on): each must be what the block's ``__init__`` sizes the block with, and equal on the traced
config to what its structure shows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hfrewrite.analyze.mamba2 import init_expressions
from hfrewrite.analyze.mixer_replay import replay_difference
from hfrewrite.analyze.plan import GatedDeltaNetPlan, NoMatch

PATTERN = "gated_delta_net"
# the checkpoint's projections: Qwen3.5's four apart, which vLLM's layer loads into its
# in_proj_qkvz and in_proj_ba; or Qwen3-Next's two, interleaved per key head, loaded as they are
PROJECTIONS = {
    False: ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    True: ("in_proj_qkvz", "in_proj_ba"),
}
CHILDREN = ("conv1d", "norm", "out_proj")
PARAMETERS = ("A_log", "dt_bias")
NOT_A_GDN = (
    f"not a gated delta net ({', '.join(PROJECTIONS[False] + CHILDREN + PARAMETERS)}; or "
    f"{', '.join(PROJECTIONS[True])} for q, k, v, z and b, a interleaved per key head)"
)
_TOKENS = 7  # longer than the convolution, so that its window and the recurrence are exercised
_ACTIVATIONS = ("silu", "swish")  # what vLLM's convolution and its gate apply here
# what vLLM's class reads of the config -> the size of the block it must equal
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


def analyze_gated_delta_net(layer: nn.Module, attr: str, config) -> GatedDeltaNetPlan | NoMatch:
    """The plan of the block ``layer.<attr>`` when it is vLLM's gated delta net on ``config``
    (the traced config), else why not."""
    module = layer.get_submodule(attr)
    name = type(module).__name__
    weighted = {n for n, m in module.named_children() if any(True for _ in m.parameters())}
    params = {n for n, _ in module.named_parameters(recurse=False)}
    layouts = [i for i, parts in PROJECTIONS.items() if weighted == {*parts, *CHILDREN}]
    if len(layouts) != 1 or params != set(PARAMETERS):
        return NoMatch(PATTERN, name, NOT_A_GDN)
    interleaved = layouts[0]
    sizes = _sizes(module, interleaved)
    if isinstance(sizes, str):
        return NoMatch(PATTERN, name, sizes)
    read = _read_from_config(type(module), config, sizes)
    if isinstance(read, str):
        return NoMatch(PATTERN, name, read)
    activation = getattr(config, "hidden_act", None)
    gate = getattr(config, "output_gate_type", "silu")
    if activation not in _ACTIVATIONS or gate not in _ACTIVATIONS:
        return NoMatch(
            PATTERN, name, f"config.hidden_act ({activation!r}) or its gate ({gate!r}) is not silu"
        )
    difference = replay_difference(
        module, sizes["hidden_size"], _TOKENS, lambda hidden: reference(module, hidden, read, interleaved)
    )
    if difference is None or difference > 1e-4:
        shown = "fails" if difference is None else f"differs by {difference:.2e}"
        return NoMatch(PATTERN, name, f"replaying vLLM's gated delta net {shown}")
    why = "vLLM's gated delta net applies silu in its convolution and its gate, as the traced block does"
    return GatedDeltaNetPlan(
        module_class=name,
        attr=attr,
        interleaved=interleaved,
        fixed=(
            (f"config.hidden_act in {_ACTIVATIONS!r}".replace("'", '"'), why),
            (f"{_GATE} in {_ACTIVATIONS!r}".replace("'", '"'), why),
        ),
    )


def _sizes(module: nn.Module, interleaved: bool) -> dict | str:
    """The block's sizes as its structure shows them (a str: why it is not one)."""
    linears = [module.get_submodule(n) for n in (*PROJECTIONS[interleaved], "out_proj")]
    conv, out = module.conv1d, linears[-1]
    if not (type(conv) is nn.Conv1d and all(type(x) is nn.Linear for x in linears)):
        return "its conv1d and projections are not a Conv1d and Linears"
    if any(x.bias is not None for x in linears):
        return "its projections have biases, which vLLM's gated delta net has not"
    channels, heads = conv.in_channels, module.A_log.numel()
    head_v = module.norm.weight.numel()
    value_dim = heads * head_v
    # q, k, v then z; b then a: one projection of each pair, or one each
    widths = [channels + value_dim, 2 * heads] if interleaved else [channels, value_dim, heads, heads]
    if [x.out_features for x in linears[:-1]] != widths or len({x.in_features for x in linears[:-1]}) != 1:
        return f"its projections are not q, k, v ({channels}), z ({value_dim}), b and a ({heads} each) of one input"
    if not (conv.groups == channels == conv.out_channels and conv.bias is None):
        return f"conv1d is not a depthwise convolution without bias over its {channels} q, k, v channels"
    if conv.stride != (1,) or conv.dilation != (1,):
        return "conv1d is strided or dilated"
    if module.dt_bias.numel() != heads or out.in_features != value_dim or (channels - value_dim) % 2:
        return f"dt_bias and out_proj are not {heads} value heads of {head_v} (the norm's width)"
    eps = [v for v in vars(module.norm).values() if type(v) is float]
    if len(eps) != 1:
        return "its norm keeps no one epsilon"
    return {
        "hidden_size": out.out_features,
        "linear_num_value_heads": heads,
        "linear_value_head_dim": head_v,
        "key_dim": (channels - value_dim) // 2,
        "linear_conv_kernel_dim": conv.kernel_size[0],
        "rms_norm_eps": eps[0],
    }


def _read_from_config(cls: type, config, sizes: dict) -> dict | str:
    """``sizes`` with the key heads and their width, after proving that each config attribute
    vLLM's class reads is one the block's ``__init__`` is built from and, on ``config``, what
    its structure shows (a str: why not)."""
    built_from = {code for _, code, _ in init_expressions(cls, config)}
    for attr in _READ:
        if f"config.{attr}" not in built_from:
            return f"its __init__ does not read config.{attr}, which vLLM's gated delta net is sized by"
    got = {attr: getattr(config, attr) for attr in _READ}
    heads, width = got["linear_num_key_heads"], got["linear_key_head_dim"]
    if heads * width != sizes["key_dim"] or got["linear_num_value_heads"] % heads:
        return f"config.linear_num_key_heads ({heads}) by linear_key_head_dim ({width}) is not its key width"
    for attr, want in sizes.items():
        if attr in got and got[attr] != want:
            return f"config.{attr} is {got[attr]!r} where the traced block has {want!r}"
    return {**sizes, "linear_num_key_heads": heads, "linear_key_head_dim": width}


def _projected(module: nn.Module, hidden: torch.Tensor, sizes: dict, interleaved: bool) -> tuple:
    """(q, k, v as the convolution reads them, z, b, a) of ``hidden``; Qwen3-Next's two
    projections taken apart per key head as vLLM's layer does (``[q k v z]`` and ``[b a]``
    per key head, the value heads of a key head consecutive)."""
    if not interleaved:
        return tuple(module.get_submodule(n)(hidden) for n in PROJECTIONS[False])
    heads_k, heads_v = sizes["linear_num_key_heads"], sizes["linear_num_value_heads"]
    dk, dv, per = sizes["linear_key_head_dim"], sizes["linear_value_head_dim"], heads_v // heads_k
    batch, tokens, _ = hidden.shape
    qkvz = module.in_proj_qkvz(hidden).reshape(batch, tokens, heads_k, -1)
    ba = module.in_proj_ba(hidden).reshape(batch, tokens, heads_k, 2 * per)
    parts = (*qkvz.split([dk, dk, per * dv, per * dv], dim=-1), *ba.split([per, per], dim=-1))
    q, k, v, z, b, a = (x.reshape(batch, tokens, -1) for x in parts)
    return torch.cat((q, k, v), dim=-1), z, b, a


def reference(
    module: nn.Module, hidden: torch.Tensor, sizes: dict, interleaved: bool = False
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
    qkv, z, b, a = _projected(module, hidden, sizes, interleaved)
    qkv = qkv.transpose(1, 2)
    qkv = F.silu(F.conv1d(F.pad(qkv, (kernel - 1, 0)), module.conv1d.weight, groups=qkv.shape[1]))
    q, k, v = qkv.transpose(1, 2).float().split([heads_k * dk, heads_k * dk, heads_v * dv], dim=-1)
    q, k = (_l2norm(x.reshape(batch, tokens, heads_k, dk)) for x in (q, k))
    q, k = (x.repeat_interleave(heads_v // heads_k, dim=2) for x in (q * dk**-0.5, k))
    v = v.reshape(batch, tokens, heads_v, dv)
    beta = torch.sigmoid(b.float())
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
    o = (module.norm.weight.float() * o * F.silu(z)).reshape(batch, tokens, heads_v * dv)
    return module.out_proj(o.to(hidden.dtype))


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """Each head's vector over its L2 norm, as vLLM's kernels take it (epsilon 1e-6 inside)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)
