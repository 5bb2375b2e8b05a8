"""Gated short convolutions (LFM2's mixer): the layers of a hybrid model that mix tokens
with a causal depthwise convolution instead of attention, which vLLM runs as its own
``ShortConv`` layer with a convolution state cache.

vLLM's ``ShortConv`` computes, per token stream, ``B, C, x = in_proj(h).chunk(3)``, then
``out_proj(C * conv(B * x))``, the convolution causal and depthwise over the last
``conv_L_cache`` tokens. A block is replaced by it only when replaying that formula with the
block's own weights reproduces the block on values, and when ``ShortConv``, which reads its
kernel size and bias switch off the config, builds the same layer from the traced config."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hfrewrite.analyze.mixer_replay import replay_difference
from hfrewrite.analyze.plan import NoMatch, ShortConvPlan

PATTERN = "short_conv"
# the children vLLM's ShortConv builds: the checkpoint's names load into them as they are
CHILDREN = ("in_proj", "conv", "out_proj")
NOT_A_CONV = "not one Conv1d and two Linears"
_TOKENS = 7  # longer than the kernels tried, so that the causal window is exercised


def analyze_short_conv(layer: nn.Module, attr: str, config) -> ShortConvPlan | NoMatch:
    """The plan of the block ``layer.<attr>`` when it is vLLM's gated short convolution on
    ``config`` (the traced config), else why not."""
    module = layer.get_submodule(attr)
    name = type(module).__name__
    children = dict(module.named_children())
    convs = [n for n, m in children.items() if type(m) is nn.Conv1d]
    linears = [n for n, m in children.items() if type(m) is nn.Linear]
    if len(convs) != 1 or len(linears) != 2 or len(children) != 3:
        return NoMatch(PATTERN, name, NOT_A_CONV)
    conv = children[convs[0]]
    dim = conv.in_channels
    if not (conv.groups == dim == conv.out_channels and conv.stride == (1,) and conv.dilation == (1,)):
        return NoMatch(PATTERN, name, f"{convs[0]} is not a depthwise convolution over {dim} channels")
    by_shape = {(children[n].in_features, children[n].out_features): n for n in linears}
    roles = {"conv": convs[0], "in_proj": by_shape.get((dim, 3 * dim)), "out_proj": by_shape.get((dim, dim))}
    if None in roles.values():
        return NoMatch(PATTERN, name, f"no [{dim} -> 3 * {dim}] input and [{dim} -> {dim}] output projection")
    if any(roles[role] != role for role in CHILDREN):
        found = ", ".join(roles[role] for role in CHILDREN)
        return NoMatch(
            PATTERN, name, f"its parts are named {found}, not vLLM's ShortConv's {', '.join(CHILDREN)}"
        )
    why = _config_fits(module, config)
    if why:
        return NoMatch(PATTERN, name, why)
    difference = replay_difference(
        module, module.conv.in_channels, _TOKENS, lambda hidden: reference(module, hidden)
    )
    if difference is None or difference > 1e-5:
        shown = "fails" if difference is None else f"differs by {difference:.2e}"
        return NoMatch(PATTERN, name, f"replaying vLLM's gated short convolution {shown}")
    return ShortConvPlan(module_class=name, attr=attr, kernel=conv.kernel_size[0], bias=conv.bias is not None)


def _config_fits(module: nn.Module, config) -> str:
    """Why vLLM's ShortConv, built from ``config``, would not have the block's kernel size and
    biases ("" when it would)."""
    kernel, bias = getattr(config, "conv_L_cache", None), getattr(config, "conv_bias", None)
    if kernel != module.conv.kernel_size[0]:
        return f"vLLM's ShortConv takes its kernel size from config.conv_L_cache ({kernel}), not {module.conv.kernel_size[0]}"
    biases = {part: getattr(module, part).bias is not None for part in CHILDREN}
    if set(biases.values()) != {bool(bias)}:
        return f"vLLM's ShortConv gives every part a bias when config.conv_bias ({bias}) says so, unlike {biases}"
    return ""


def reference(module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """vLLM's gated short convolution of ``hidden`` [batch, tokens, dim] from a zero state,
    with the block's weights."""
    b, c, x = module.in_proj(hidden).chunk(3, dim=-1)
    gated = (b * x).transpose(1, 2)  # [batch, dim, tokens]
    kernel = module.conv.kernel_size[0]
    mixed = F.conv1d(
        F.pad(gated, (kernel - 1, 0)), module.conv.weight, module.conv.bias, groups=gated.shape[1]
    )
    return module.out_proj(c * mixed.transpose(1, 2))
