"""Mamba-1 blocks (Mamba's, FalconMamba's selective scans): the layers that mix tokens with a
state per channel, which vLLM runs as its own ``MambaMixer`` with a convolution state and a
recurrent state in its cache.

vLLM's ``MambaMixer`` computes ``x, z = in_proj(h)``, a causal depthwise convolution of ``x``
then silu, ``t, B, C = x_proj(x)`` (each RMS-normed where ``use_rms_norm``, with or without a
weight), ``dt = softplus(dt_proj(t))``, the scan ``s = exp(dt A) s + dt B x`` and
``y = C s + D x`` per channel (``A = -exp(A_log)``, one state of ``ssm_state_size`` each),
then ``out_proj(y * silu(z))``. A block is replaced by it only when replaying that formula
with the block's own weights reproduces the block on values. Like ``MambaMixer2`` it is
built from arguments: each is the expression of the config the block's ``__init__``
assigns, kept only when its traced value is what the block's structure shows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hfrewrite.analyze.mamba2 import init_expressions, one_expression
from hfrewrite.analyze.mixer_plans import Mamba1Plan
from hfrewrite.analyze.mixer_replay import replay_difference
from hfrewrite.analyze.plan import NoMatch

PATTERN = "mamba1"
CHILDREN = ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj")
PARAMETERS = ("A_log", "D")
# the RMS norms of the time steps, B and C vLLM's mixer has under use_rms_norm (FalconMamba's
# weightless ones, Jamba's with weights), under the names its checkpoint loads them by
NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")
NOT_A_MAMBA1 = "not a Mamba-1 block (in_proj, conv1d, x_proj, dt_proj, out_proj, A_log, D)"
_TOKENS = 7  # longer than the convolution, so that its window and the scan are exercised
_ACTIVATIONS = ("silu", "swish")  # what vLLM's causal convolution applies


def analyze_mamba1(layer: nn.Module, attr: str, config) -> Mamba1Plan | NoMatch:
    """The plan of the block ``layer.<attr>`` when it is vLLM's Mamba-1 mixer on ``config``
    (the traced config), else why not."""
    module = layer.get_submodule(attr)
    name = type(module).__name__
    weighted = {n for n, m in module.named_children() if any(True for _ in m.parameters())}
    params = {n for n, _ in module.named_parameters(recurse=False)}
    if not set(CHILDREN) <= weighted <= set(CHILDREN) | set(NORMS) or params != set(PARAMETERS):
        return NoMatch(PATTERN, name, NOT_A_MAMBA1)
    sizes = _sizes(module)
    if isinstance(sizes, str):
        return NoMatch(PATTERN, name, sizes)
    exprs = init_expressions(type(module), config)
    args = {}
    for kw, want in sizes.items():
        args[kw] = one_expression(exprs, kw, lambda v, want=want: type(v) is type(want) and v == want)
        if args[kw] is None:
            return NoMatch(PATTERN, name, f"no expression of its config in __init__ gives {kw} ({want})")
    args["activation"] = one_expression(exprs, "activation", lambda v: type(v) is str)
    if args["activation"] is None or args["activation"][1] not in _ACTIVATIONS:
        return NoMatch(
            PATTERN, name, "its convolution's activation is not an expression of its config giving silu"
        )
    norms = _norms(module, weighted, exprs)
    if isinstance(norms, str):
        return NoMatch(PATTERN, name, norms)
    args.update(norms)
    values = {kw: value for kw, (_, value) in args.items()}
    difference = replay_difference(
        module, values["hidden_size"], _TOKENS, lambda h: reference(module, h, values)
    )
    if difference is None or difference > 1e-4:
        shown = "fails" if difference is None else f"differs by {difference:.2e}"
        return NoMatch(PATTERN, name, f"replaying vLLM's Mamba-1 mixer {shown}")
    activation = args["activation"][0]
    return Mamba1Plan(
        module_class=name,
        attr=attr,
        args=tuple((kw, expr) for kw, (expr, _) in args.items()),
        fixed=(
            (
                f"{activation} in {_ACTIVATIONS!r}".replace("'", '"'),
                "vLLM's causal convolution applies silu or nothing",
            ),
        ),
    )


def _sizes(module: nn.Module) -> dict | str:
    """What the block's structure shows of MambaMixer's arguments (a str: why it is not one)."""
    parts = [getattr(module, n) for n in CHILDREN]
    if type(parts[1]) is not nn.Conv1d or any(
        type(p) is not nn.Linear for i, p in enumerate(parts) if i != 1
    ):
        return "its conv1d is not a Conv1d, or its projections are not Linears"
    in_proj, conv, x_proj, dt_proj, out_proj = parts
    inner, hidden = out_proj.in_features, in_proj.in_features
    if module.A_log.dim() != 2 or module.A_log.shape[0] != inner or module.D.shape != (inner,):
        return f"A_log is not [{inner}, state] or D not one per channel"
    state, rank = module.A_log.shape[1], dt_proj.in_features
    if not (
        conv.groups == conv.in_channels == conv.out_channels == inner
        and conv.stride == (1,)
        and conv.dilation == (1,)
    ):
        return f"conv1d is not a depthwise convolution over {inner} channels"
    if in_proj.out_features != 2 * inner or out_proj.out_features != hidden:
        return f"in_proj does not project to [{inner} + {inner}] (convolution input, gate)"
    if x_proj.out_features != rank + 2 * state or x_proj.bias is not None or dt_proj.out_features != inner:
        return f"x_proj does not give [{rank} + {state} + {state}] without bias (time steps, B, C)"
    if dt_proj.bias is None:  # vLLM's dt_proj always has one, which the checkpoint would lack
        return "dt_proj has no bias"
    if (in_proj.bias is None) != (out_proj.bias is None):
        return "its projections differ in bias"
    return {
        "hidden_size": hidden,
        "ssm_state_size": state,
        "conv_kernel_size": conv.kernel_size[0],
        "intermediate_size": inner,
        "time_step_rank": rank,
        "use_conv_bias": conv.bias is not None,
        "use_bias": in_proj.bias is not None,
    }


def _norms(module: nn.Module, weighted: set[str], exprs) -> dict | str:
    """MambaMixer's norm arguments, (expression, value) each: none where the block has no
    norms of its time steps, B and C; else their epsilon, the config expression its norms
    are built with, and whether they carry weights (all three or none)."""
    present = [n for n in NORMS if isinstance(getattr(module, n, None), nn.Module)]
    if not present:
        return {"use_rms_norm": ("False", False)}
    if len(present) != len(NORMS) or len(weighted & set(NORMS)) not in (0, len(NORMS)):
        return "some of its norms of the time steps, B and C are missing or weightless, others not"
    eps = {v for n in NORMS for v in vars(getattr(module, n)).values() if type(v) is float}
    if len(eps) != 1:
        return "its norms of the time steps, B and C keep no one epsilon"
    value = eps.pop()
    keyed = [e for e in exprs if e[0] in {f"{n}(eps=)" for n in NORMS}]  # the norms' own arguments first
    expression = one_expression(keyed, "eps", lambda v: v == value) or one_expression(
        exprs, "rms_eps", lambda v: type(v) is float and v == value
    )
    if expression is None:
        return f"no expression of its config in __init__ gives its norms' epsilon ({value})"
    has_weight = bool(weighted & set(NORMS))
    return {
        "use_rms_norm": ("True", True),
        "rms_norm_has_weight": (str(has_weight), has_weight),
        "rms_norm_eps": expression,
    }


def reference(module: nn.Module, hidden: torch.Tensor, values: dict) -> torch.Tensor:
    """vLLM's Mamba-1 mixer of ``hidden`` [batch, tokens, hidden] from a zero state, with the
    block's weights and the arguments ``values``, the scan taken token by token."""
    inner, state_size = values["intermediate_size"], values["ssm_state_size"]
    kernel, rank = values["conv_kernel_size"], values["time_step_rank"]
    batch, tokens, _ = hidden.shape
    x, gate = module.in_proj(hidden).chunk(2, dim=-1)
    x = F.conv1d(
        F.pad(x.transpose(1, 2), (kernel - 1, 0)), module.conv1d.weight, module.conv1d.bias, groups=inner
    )
    x = F.silu(x).transpose(1, 2)
    time_step, b, c = module.x_proj(x).split([rank, state_size, state_size], dim=-1)
    if values["use_rms_norm"]:
        time_step, b, c = (
            _rms(
                part, values["rms_norm_eps"], getattr(module, norm) if values["rms_norm_has_weight"] else None
            )
            for part, norm in zip((time_step, b, c), NORMS)
        )
    dt = F.softplus(module.dt_proj(time_step))
    a = -torch.exp(module.A_log.float())
    state = hidden.new_zeros(batch, inner, state_size)
    out = []
    for i in range(tokens):
        state = torch.exp(dt[:, i, :, None] * a) * state + (dt[:, i] * x[:, i])[..., None] * b[:, i, None, :]
        out.append((state * c[:, i, None, :]).sum(-1) + module.D * x[:, i])
    return module.out_proj(torch.stack(out, dim=1) * F.silu(gate))


def _rms(part: torch.Tensor, eps: float, norm: nn.Module | None) -> torch.Tensor:
    normed = part * torch.rsqrt(part.pow(2).mean(-1, keepdim=True) + eps)
    return normed if norm is None else norm.weight * normed
