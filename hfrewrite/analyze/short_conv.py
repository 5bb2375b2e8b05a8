"""Gated short convolutions (LFM2's mixer): the layers of a hybrid model that mix tokens
with a causal depthwise convolution instead of attention, which vLLM runs as its own
``ShortConv`` layer with a convolution state cache.

vLLM's ``ShortConv`` computes, per token stream, ``B, C, x = in_proj(h).chunk(3)``, then
``out_proj(C * conv(B * x))``, the convolution causal and depthwise over the last
``conv_L_cache`` tokens. A block is replaced by it only when replaying that formula with the
block's own weights reproduces the block on values, and when ``ShortConv``, which reads its
kernel size and bias switch off the config, builds the same layer from the traced config."""

from __future__ import annotations

import ast
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from hfrewrite.analyze.branches import method_tree
from hfrewrite.analyze.plan import NoMatch, Refusal, ShortConvPlan

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
    difference = _replay_difference(module)
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


def _replay_difference(module: nn.Module) -> float | None:
    """The largest difference between the block and vLLM's formula on one random input."""
    generator = torch.Generator().manual_seed(0)
    dim = module.conv.in_channels
    weight = module.in_proj.weight
    hidden = torch.randn(2, _TOKENS, dim, generator=generator, dtype=weight.dtype)
    with torch.no_grad():
        try:
            got = module(hidden)
        except Exception:  # noqa: BLE001 - a block that needs more than its hidden states
            return None
        got = got[0] if isinstance(got, tuple) else got
        want = reference(module, hidden)
    if not (torch.is_tensor(got) and got.shape == want.shape):
        return None
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


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


def with_layer_test(
    plan: ShortConvPlan, layers: list[nn.Module], attention: list[bool], block: str
) -> ShortConvPlan:
    """``plan`` with the decoder layer's own test choosing its mixer: an ``if`` of its forward
    calling ``self.<block>`` (the attention) on one side and the mixer on the other, whose
    test, evaluated on each traced layer, is true exactly where that layer has attention."""
    cls = type(layers[0])
    tree = method_tree(cls, "forward")
    found = []
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.If):
            body, orelse = _self_calls(node.body), _self_calls(node.orelse)
            if (
                {block, plan.attr} <= body | orelse
                and not {block, plan.attr} <= body
                and not {block, plan.attr} <= orelse
            ):
                found.append((node.test, block in body))
    if len(found) != 1:
        raise Refusal(
            NoMatch(PATTERN, cls.__name__, f"no one test of its forward chooses {block} or {plan.attr}")
        )
    test, attention_when = found[0]
    code = compile(ast.Expression(test), "<test>", "eval")
    for layer, has_attention in zip(layers, attention):
        try:
            chosen = bool(eval(code, {}, {"self": layer})) == attention_when  # the source's own test
        except Exception:  # noqa: BLE001 - a test on more than the layer
            chosen = None
        if chosen is not has_attention:
            raise Refusal(
                NoMatch(
                    PATTERN, cls.__name__, f"`{ast.unparse(test)}` does not tell its attention layers apart"
                )
            )
    return dataclasses.replace(plan, layer_test=ast.unparse(test), attention_when=attention_when)


def _self_calls(statements: list[ast.stmt]) -> set[str]:
    """The ``self.<attr>(...)`` calls anywhere in ``statements``."""
    return {
        node.func.attr
        for statement in statements
        for node in ast.walk(statement)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    }
