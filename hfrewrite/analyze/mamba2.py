"""Mamba-2 blocks (Bamba's and Granite-4.0-H's mixer): the layers of a hybrid model that mix
tokens with a selective state space, which vLLM runs as its own ``MambaMixer2`` with a
convolution state and a recurrent state in its cache.

vLLM's ``MambaMixer2`` computes ``z, xBC, dt = in_proj(h)``, a causal depthwise convolution
of ``xBC`` then silu, ``x, B, C = xBC``, the scan ``s = exp(dt A) s + dt B x``,
``y = C s + D x`` per head (``dt = softplus(dt + dt_bias)``, ``A = -exp(A_log)``, heads
sharing the B and C of their group), then ``out_proj(norm(y * silu(z)))``, the RMS norm taken
over each group's channels. A block is replaced by it only when replaying that formula with
the block's own weights reproduces the block on values. ``MambaMixer2`` is built from
arguments, not a config: each is the expression of the config the block's ``__init__``
assigns, kept only when its traced value is what the block's structure shows. A block without
its gated norm (Falcon-H1's ``nn.Identity()`` under ``mamba_rms_norm``) is vLLM's with
``use_rms_norm=False``; the factors of its input and of its projection's columns (Falcon-H1's
muP multipliers) are proven by mamba2_scales.py, its time-step limits by mamba2_floor.py."""

from __future__ import annotations

import ast

import torch
import torch.nn.functional as F
from torch import nn

from hfrewrite.analyze.branches import method_tree
from hfrewrite.analyze.mamba2_floor import floor_replay, time_step_limits
from hfrewrite.analyze.mamba2_scales import (
    changed_replays,
    input_scale,
    output_changes,
    projection,
    read_scales,
)
from hfrewrite.analyze.mixer_replay import replay_difference
from hfrewrite.analyze.plan import Mamba2Plan, NoMatch

PATTERN = "mamba2"
# the parts vLLM's MambaMixer2 builds, under the checkpoint's names (A_log is loaded as A)
CHILDREN = ("in_proj", "conv1d", "norm", "out_proj")
PARAMETERS = ("A_log", "D", "dt_bias")
NOT_A_MAMBA2 = "not a Mamba-2 block (in_proj, conv1d, norm, out_proj, A_log, D, dt_bias)"
_TOKENS = 7  # longer than the convolution, so that its window and the scan are exercised
_ACTIVATIONS = ("silu", "swish")  # what vLLM's causal convolution applies


def analyze_mamba2(layer: nn.Module, attr: str, config) -> Mamba2Plan | NoMatch:
    """The plan of the block ``layer.<attr>`` when it is vLLM's Mamba-2 mixer on ``config``
    (the traced config), else why not."""
    module = layer.get_submodule(attr)
    name = type(module).__name__
    weighted = {n for n, m in module.named_children() if any(True for _ in m.parameters())}
    params = {n for n, _ in module.named_parameters(recurse=False)}
    normed = "norm" in weighted  # else a weightless identity (Falcon-H1's without mamba_rms_norm)
    if weighted | {"norm"} != set(CHILDREN) or params != set(PARAMETERS) or not hasattr(module, "norm"):
        return NoMatch(PATTERN, name, NOT_A_MAMBA2)
    sizes = _sizes(module, normed)
    if isinstance(sizes, str):
        return NoMatch(PATTERN, name, sizes)
    args = _arguments(type(module), config, sizes)
    if isinstance(args, str):
        return NoMatch(PATTERN, name, args)
    if not normed:
        args["use_rms_norm"] = ("False", False)
    values = {kw: value for kw, (_, value) in args.items()}
    if values["activation"] not in _ACTIVATIONS:
        return NoMatch(PATTERN, name, f"its convolution's activation is {values['activation']!r}, not silu")
    limits = time_step_limits(init_expressions(type(module), config))
    if isinstance(limits, str):
        return NoMatch(PATTERN, name, limits)
    values["time_step_floor"] = limits.floor_value
    fixed = limits.conditions + _fixed(args)
    expressions = {a: code for a, code, _ in init_expressions(type(module), config)}
    flags = _norm_flags(module, values, expressions) if normed else ()
    if isinstance(flags, str):
        return NoMatch(PATTERN, name, flags)
    scales = read_scales(module, config, values["hidden_size"], _TOKENS, expressions)
    if isinstance(scales, str):
        return NoMatch(PATTERN, name, scales)
    values = _replayed(module, values, scales)
    if isinstance(values, str):
        return NoMatch(PATTERN, name, values)
    scaled = lambda h, s, p: reference(module, h, values, s, p)
    if (why := changed_replays(module, scales, values["hidden_size"], _TOKENS, scaled)) is not None:
        return NoMatch(PATTERN, name, why)
    spans = "norm_groups" in values  # its gated norm over all channels, however many groups
    if sum(map(bool, (scales.input_expr or scales.projection_expr, limits.floor, spans))) > 1:
        return NoMatch(
            PATTERN, name, "muP factors, a time-step floor or a norm over all groups: not proven together"
        )
    if limits.floor and (why := _floor_proof(module, values, limits.floor_value)) is not None:
        return NoMatch(PATTERN, name, why)
    return Mamba2Plan(
        module_class=name,
        attr=attr,
        args=tuple((kw, expr) for kw, (expr, _) in args.items()),
        fixed=fixed + _norm_switch(type(module), config, normed) + flags,
        input_scale=scales.input_expr,
        projection_scale=scales.projection_expr,
        projection_buffer=scales.projection_buffer,
        time_step_floor=limits.floor,
        norm_spans_groups=spans,
    )


def _replayed(module: nn.Module, values: dict, scales) -> dict | str:
    """``values`` under which vLLM's formula replays the block; with ``norm_groups`` 1 where
    only a gated norm over all channels does (transformers' Mamba-2 and Bamba blocks with
    several groups: vLLM's norm is over each group's, the file's then over one); a str: why
    neither does."""
    tries = [values]
    if values["n_groups"] > 1 and values.get("use_rms_norm", True):
        tries.append({**values, "norm_groups": 1})
    differences = []
    for tried in tries:
        difference = replay_difference(
            module,
            values["hidden_size"],
            _TOKENS,
            lambda h, tried=tried: reference(
                module, h, tried, input_scale(module, scales), projection(module, scales)
            ),
        )
        if difference is not None and difference <= 1e-4:
            return tried
        differences.append(difference)
    shown = "fails" if differences[0] is None else f"differs by {differences[0]:.2e}"
    return f"replaying vLLM's Mamba-2 mixer {shown}"


def _floor_proof(module: nn.Module, values: dict, floor: float) -> str | None:
    """Why the block's time-step floor is not proven (None: it is)."""
    return floor_replay(
        module,
        values["hidden_size"],
        _TOKENS,
        lambda hidden, at: reference(module, hidden, {**values, "time_step_floor": at}),
        floor,
    )


def _sizes(module: nn.Module, normed: bool = True) -> dict | str:
    """What the block's structure shows of MambaMixer2's arguments (a str: why it is not one);
    ``normed``: the block has its gated norm (its epsilon is then one)."""
    conv, in_proj, out_proj = module.conv1d, module.in_proj, module.out_proj
    if not (type(conv) is nn.Conv1d and type(in_proj) is nn.Linear and type(out_proj) is nn.Linear):
        return "its conv1d, in_proj and out_proj are not a Conv1d and two Linears"
    channels, heads, inner = conv.in_channels, module.A_log.numel(), out_proj.in_features
    if not (conv.groups == channels == conv.out_channels and conv.stride == (1,) and conv.dilation == (1,)):
        return f"conv1d is not a depthwise convolution over {channels} channels"
    hidden = in_proj.in_features
    if in_proj.out_features != inner + channels + heads or out_proj.out_features != hidden:
        return f"in_proj does not project to [{inner} + {channels} + {heads}] (gate, conv input, time steps)"
    if module.D.numel() != heads or module.dt_bias.numel() != heads or inner % heads:
        return f"D and dt_bias are not one per head of {heads}, or {heads} heads do not split {inner}"
    if (in_proj.bias is None) != (out_proj.bias is None) or (normed and module.norm.weight.numel() != inner):
        return "its projections differ in bias, or its norm is not over the gated output"
    eps = [v for v in vars(module.norm).values() if type(v) is float]
    if normed and len(eps) != 1:
        return "its norm keeps no one epsilon"
    return {
        "hidden_size": hidden,
        "conv_kernel_size": conv.kernel_size[0],
        "intermediate_size": inner,
        "use_conv_bias": conv.bias is not None,
        "use_bias": in_proj.bias is not None,
        "num_heads": heads,
        "head_dim": inner // heads,
        **({"rms_norm_eps": eps[0]} if normed else {}),
        "groups_times_state": (channels - inner) // 2,
    }


def init_expressions(cls: type, config) -> list[tuple[str, str, object]]:
    """(attribute, expression of ``config``, its value on ``config``) for each
    ``self.<attribute> = ...`` of ``cls.__init__`` that reads the config alone, earlier
    attributes substituted into later ones; a float or a string the source writes itself."""
    tree = method_tree(cls, "__init__")
    found: dict[str, ast.expr] = {}

    class Assignments(ast.NodeVisitor):  # in source order
        def visit_Assign(self, node):
            target = node.targets[0]
            if len(node.targets) == 1 and isinstance(target, ast.Attribute) and _is_self(target.value):
                found[target.attr] = _substituted(node.value, found)
                # a part's keyword arguments too (NemotronH's `nn.Linear(..., bias=config.use_bias)`),
                # also of a part built under a test (Falcon-H1's `Norm(...) if ... else nn.Identity()`)
                built = node.value.body if isinstance(node.value, ast.IfExp) else node.value
                for keyword in built.keywords if isinstance(built, ast.Call) else ():
                    if keyword.arg:
                        found[f"{target.attr}({keyword.arg}=)"] = _substituted(keyword.value, found)

    if tree is not None:
        Assignments().visit(tree)
    out = []
    for attr, expr in found.items():
        names = {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}
        # an eps or a name written in the source (Zamba2's `Norm(..., eps=1e-5)`, its
        # `self.activation = "silu"`): every config's (never a size: an int must read the config)
        written = isinstance(expr, ast.Constant) and type(expr.value) in (float, str)
        if not written and ("config" not in names or names - {"config", "int", "float", "tuple"}):
            continue
        code = ast.unparse(expr)
        try:
            value = eval(
                code, {"int": int, "float": float, "tuple": tuple}, {"config": config}
            )  # the source's own
        except Exception:  # noqa: BLE001, S112 - an expression that does not evaluate on this config
            continue
        out.append((attr, code, value))
    return out


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _substituted(expr: ast.expr, known: dict[str, ast.expr]) -> ast.expr:
    """``expr`` with each ``self.<attr>`` assigned before replaced by its expression."""

    class Substitute(ast.NodeTransformer):
        def visit_Attribute(self, node):
            if _is_self(node.value) and node.attr in known:
                return known[node.attr]
            return self.generic_visit(node)

    return Substitute().visit(ast.parse(ast.unparse(expr), mode="eval")).body


def _arguments(cls: type, config, sizes: dict) -> dict | str:
    """MambaMixer2's keyword -> (config expression, traced value), each the one expression of
    the block's ``__init__`` whose value is what the structure shows (among several of that
    value, the attribute of the keyword's own name); groups and state size are the pair whose
    product the convolution's width shows."""
    exprs = init_expressions(cls, config)
    chosen = {}
    for kw, want in sizes.items():
        if kw != "groups_times_state":
            chosen[kw] = one_expression(exprs, kw, lambda v, want=want: type(v) is type(want) and v == want)
            if chosen[kw] is None:
                return f"no expression of its config in __init__ gives {kw} ({want})"
    for kw in ("activation", "n_groups", "ssm_state_size"):
        kind = str if kw == "activation" else int
        chosen[kw] = one_expression(exprs, kw, lambda v, kind=kind: type(v) is kind)
        if chosen[kw] is None:
            return f"no expression of its config in __init__ gives {kw}"
    groups, state = chosen["n_groups"][1], chosen["ssm_state_size"][1]
    if groups * state != sizes["groups_times_state"] or sizes["num_heads"] % groups:
        return f"n_groups ({groups}) and ssm_state_size ({state}) do not size its convolution"
    return chosen


def one_expression(exprs, kw: str, fits) -> tuple[str, object] | None:
    """The expression of ``exprs`` fitting: the only one, or the one assigned to ``kw``."""
    found: dict[tuple[str, str], set[str]] = {}
    for attr, code, value in exprs:
        if fits(value):
            found.setdefault((code, repr(value)), set()).add(attr)
    if len(found) > 1:
        found = {key: attrs for key, attrs in found.items() if kw in attrs}
    if len(found) != 1:
        return None
    code = next(iter(found))[0]
    return code, next(value for _, c, value in exprs if c == code)


_ONE_GROUP = "proven with one group only, where a norm over all channels is vLLM's norm over each group's"
_SILU = "vLLM's causal convolution applies silu or nothing"


def _fixed(args: dict) -> tuple[tuple[str, str], ...]:
    """What the file requires of every config besides the time-step limits (mamba2_floor.py),
    as (condition, why): the convolution's activation silu; and one group where the traced
    block has one, since with one group a norm over all channels and vLLM's norm over each
    group's are the same, and the replay tells them apart only with more."""
    out = [(f"{args['activation'][0]} in {_ACTIVATIONS!r}".replace("'", '"'), _SILU)]
    groups, traced = args["n_groups"]
    if traced == 1:
        out.append((f"{groups} == 1", _ONE_GROUP))
    return tuple(out)


def _norm_switch(cls: type, config, normed: bool) -> tuple[tuple[str, str], ...]:
    """Where ``__init__`` builds the norm under a test of the config (Falcon-H1's ``... if
    config.mamba_rms_norm else nn.Identity()``), that test as it was traced: the other branch's
    block was never replayed."""
    tree = method_tree(cls, "__init__")
    tests = [
        node.value.test
        for node in (ast.walk(tree) if tree is not None else ())
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Attribute)
        and _is_self(node.targets[0].value)
        and node.targets[0].attr == "norm"
        and isinstance(node.value, ast.IfExp)
    ]
    if len(tests) != 1:
        return ()
    test = _substituted(tests[0], {})
    if {n.id for n in ast.walk(test) if isinstance(n, ast.Name)} != {"config"}:
        return ()
    code = ast.unparse(test)
    why = "proven with the block's gated norm" if normed else "proven without the block's gated norm"
    return ((f"{code}" if normed else f"not ({code})", why),)


def _norm_flags(module: nn.Module, values: dict, expressions: dict) -> tuple[tuple[str, str], ...] | str:
    """The norm's switches the block's output depends on (Falcon-H1's ``norm_before_gate``),
    each at its traced value, from the config expression ``__init__`` builds the norm with."""
    out = []
    for name, value in vars(module.norm).items():
        if type(value) is not bool or not output_changes(
            module, module.norm, name, not value, values["hidden_size"], _TOKENS
        ):
            continue  # not a switch, or one its forward does not read
        expression = expressions.get(f"norm({name}=)")
        if expression is None:
            return f"its norm's switch {name} changes its output, and no expression of its config sets it"
        out.append((f"({expression}) is {value}", f"proven with the norm's {name} {value}"))
    return tuple(out)


def reference(
    module: nn.Module,
    hidden: torch.Tensor,
    values: dict,
    input_scale: float = 1.0,
    projection_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM's Mamba-2 mixer of ``hidden`` [batch, tokens, hidden] times ``input_scale`` from
    a zero state, its projection's output times ``projection_scale`` per column (vLLM's
    ``mup_vector``), with the block's weights and the sizes ``values``, the scan taken token by
    token (its time steps floored at ``values["time_step_floor"]`` where given; the gated norm
    over each of ``n_groups`` groups, or of ``values["norm_groups"]`` where given; none where
    ``values["use_rms_norm"]`` is False)."""
    inner, heads, groups = values["intermediate_size"], values["num_heads"], values["n_groups"]
    state_size, kernel = values["ssm_state_size"], values["conv_kernel_size"]
    batch, tokens, _ = hidden.shape
    channels = inner + 2 * groups * state_size
    projected = module.in_proj(hidden * input_scale)
    if projection_scale is not None:
        projected = projected * projection_scale
    gate, xbc, dt = projected.split([inner, channels, heads], dim=-1)
    xbc = F.conv1d(
        F.pad(xbc.transpose(1, 2), (kernel - 1, 0)), module.conv1d.weight, module.conv1d.bias, groups=channels
    )
    x, b, c = F.silu(xbc).transpose(1, 2).split([inner, groups * state_size, groups * state_size], dim=-1)
    x = x.reshape(batch, tokens, heads, inner // heads)
    b, c = (
        t.reshape(batch, tokens, groups, state_size).repeat_interleave(heads // groups, dim=2) for t in (b, c)
    )
    dt = F.softplus(dt + module.dt_bias).clamp(min=values.get("time_step_floor", 0.0))
    decay = torch.exp(dt * -torch.exp(module.A_log.float()))
    state = hidden.new_zeros(batch, heads, inner // heads, state_size)
    out = []
    for i in range(tokens):
        state = (
            state * decay[:, i, :, None, None]
            + (dt[:, i, :, None] * x[:, i])[..., None] * b[:, i, :, None, :]
        )
        out.append((state * c[:, i, :, None, :]).sum(-1) + module.D[:, None] * x[:, i])
    y = torch.stack(out, dim=1).reshape(batch, tokens, inner) * F.silu(gate)
    if not values.get("use_rms_norm", True):
        return module.out_proj(y)
    norm_groups = values.get("norm_groups", groups)
    grouped = y.reshape(batch, tokens, norm_groups, inner // norm_groups)
    y = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + values["rms_norm_eps"])
    return module.out_proj(module.norm.weight * y.reshape(batch, tokens, inner))
