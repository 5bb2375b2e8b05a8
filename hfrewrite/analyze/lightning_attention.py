"""Lightning attention (MiniMax-Text-01's linear attention): the layers of a hybrid model that
mix tokens with a state per head decaying at a fixed rate, which vLLM runs as its own
``MiniMaxText01LinearAttention`` with that state in its cache.

vLLM's layer computes ``q, k, v = silu(qkv_proj(h))``, laid out ``[heads, 3 * head_dim]`` per
token; per head the state ``S = exp(-slope) S + k^T v`` and the output ``q S``; then
``out_proj(sigmoid(output_gate(h)) * norm(o))``, the RMS norm over all heads. vLLM builds that
norm with epsilon 1e-5; transformers' block with 1e-6, which matters where the heads' outputs
are small: the file's layer takes the block's own (``LightningPlan.norm_eps``).
Each head's slope is ALiBi's (``2^(-8 (h + 1) / heads)`` for a power-of-two head count) times
``1 - i / (layers - 1) + 1e-5`` for the layer at index ``i``. A block is replaced by it only
when replaying that formula, with the block's weights and the slopes vLLM gives the layer's
own index, reproduces the block on values.

vLLM's class reads its sizes from the config (``num_attention_heads``, ``head_dim``,
``hidden_size``, ``num_hidden_layers``): each must give what the block's structure shows."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hfrewrite.analyze.mamba2 import init_expressions
from hfrewrite.analyze.mixer_plans import LightningPlan
from hfrewrite.analyze.mixer_replay import block_output, random_input, relative_difference
from hfrewrite.analyze.plan import NoMatch

PATTERN = "lightning_attention"
# the children vLLM's class builds: the checkpoint's names load into them as they are
CHILDREN = ("qkv_proj", "output_gate", "norm", "out_proj")
NOT_LIGHTNING = f"not a lightning-attention block ({', '.join(CHILDREN)})"
_TOKENS = 7
# vLLM's slopes equal transformers' (``base^(h + 1)``) for a power-of-two head count alone
_POWER_OF_TWO = 'bin(config.num_attention_heads).count("1") == 1'


def analyze_lightning(
    layer: nn.Module, attr: str, config, layer_idx: int | None = None
) -> LightningPlan | NoMatch:
    """The plan of the block ``layer.<attr>`` (the layer at ``layer_idx`` of the stack) when it
    is vLLM's lightning attention on ``config`` (the traced config), else why not."""
    module = layer.get_submodule(attr)
    name = type(module).__name__
    weighted = {n for n, m in module.named_children() if any(True for _ in m.parameters())}
    if weighted != set(CHILDREN) or any(True for _ in module.parameters(recurse=False)):
        return NoMatch(PATTERN, name, NOT_LIGHTNING)
    sizes = _sizes(module, config)
    if isinstance(sizes, str):
        return NoMatch(PATTERN, name, sizes)
    if layer_idx is None:
        return NoMatch(PATTERN, name, "the layer's index in the stack is not known here")
    if getattr(config, "hidden_act", None) not in ("silu", "swish"):
        return NoMatch(
            PATTERN, name, f"config.hidden_act is {config.hidden_act!r}: vLLM's layer applies silu"
        )
    heads, layers = sizes["heads"], config.num_hidden_layers
    hidden = random_input(module, 2, _TOKENS, sizes["hidden"])
    got = block_output(module, hidden, none_for_required=True)
    eps = sizes["eps"]
    with torch.no_grad():
        want = reference(module, hidden, heads, vllm_slopes(heads, layer_idx, layers), eps)
    difference = relative_difference(got, want)
    if difference is None or difference > 1e-4:
        shown = "fails" if difference is None else f"differs by {difference:.2e}"
        return NoMatch(PATTERN, name, f"replaying vLLM's lightning attention at layer {layer_idx} {shown}")
    fixed = (
        ('config.hidden_act in ("silu", "swish")', "vLLM's lightning attention applies silu to q, k and v"),
        ('getattr(config, "head_dim", None) is not None', "vLLM's lightning attention reads config.head_dim"),
        (_POWER_OF_TWO, "vLLM's decay slopes equal the traced block's for a power-of-two head count"),
    )
    buffers = tuple(
        n for n, _ in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set
    )
    rates = _rates(module, hidden, got, heads, eps, buffers)
    norm_eps = _eps_code(type(module), config, eps)
    return LightningPlan(
        module_class=name, attr=attr, fixed=fixed, norm_eps=norm_eps, buffers=buffers, rates=rates
    )


def _rates(module: nn.Module, hidden, got, heads: int, eps: float, buffers: tuple[str, ...]) -> str:
    """The persistent buffer holding the block's decay rate per head: the one, of one value
    per head, with which the formula gives the block's output exactly ("" where none does;
    then the file keeps vLLM's rates)."""
    found = []
    for name in buffers:
        rates = getattr(module, name)
        if rates.numel() != heads:
            continue
        with torch.no_grad():
            want = reference(module, hidden, heads, rates.reshape(heads).float(), eps)
        if relative_difference(got, want) < 1e-5:
            found.append(name)
    return found[0] if len(found) == 1 else ""


def _eps_code(cls: type, config, eps: float) -> str:
    """The expression of the norm's epsilon: the config's that the block's ``__init__`` passes
    it, or the traced value where it passes none (the norm class's own default)."""
    passed = [code for attr, code, _ in init_expressions(cls, config) if attr == "norm(eps=)"]
    return passed[0] if passed else repr(eps)


def _sizes(module: nn.Module, config) -> dict | str:
    """The block's sizes, as its structure shows them and as vLLM's class reads them off
    ``config`` (a str: why they differ, or why it is not one)."""
    parts = [module.get_submodule(n) for n in CHILDREN]
    qkv, gate, norm, out = parts
    if not all(type(x) is nn.Linear and x.bias is None for x in (qkv, gate, out)):
        return "its projections are not Linears without biases"
    inner, hidden = out.in_features, out.out_features
    if (qkv.in_features, qkv.out_features, gate.in_features, gate.out_features) != (
        hidden,
        3 * inner,
        hidden,
        inner,
    ):
        return f"its projections are not q, k, v ({3 * inner}) and a gate ({inner}) of the hidden states"
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.shape != (inner,):
        return f"its norm has no weight of its {inner} channels"
    eps = [v for v in vars(norm).values() if type(v) is float]
    if len(eps) != 1:
        return "its norm keeps no one epsilon"
    heads, head_dim = getattr(config, "num_attention_heads", None), getattr(config, "head_dim", None)
    if (
        not isinstance(heads, int)
        or head_dim is None
        or heads * head_dim != inner
        or config.hidden_size != hidden
    ):
        return (
            f"vLLM's class reads config.num_attention_heads ({heads}) by config.head_dim ({head_dim}) "
            f"and config.hidden_size ({config.hidden_size}), which do not give its {inner} channels of {hidden}"
        )
    return {"hidden": hidden, "heads": heads, "eps": eps[0]}


def vllm_slopes(heads: int, layer_idx: int, layers: int) -> torch.Tensor:
    """The decay rate of each head at layer ``layer_idx`` of ``layers``, as vLLM builds it."""

    def powers_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    def slopes(n: int) -> list[float]:
        if math.log2(n).is_integer():
            return powers_of_two(n)
        closest = 2 ** math.floor(math.log2(n))
        return powers_of_two(closest) + slopes(2 * closest)[0::2][: n - closest]

    rate = torch.tensor(slopes(heads), dtype=torch.float32)
    return rate * ((1 - layer_idx / (layers - 1) + 1e-5) if layers > 1 else (1 + 1e-5))


def reference(
    module: nn.Module, hidden: torch.Tensor, heads: int, slopes: torch.Tensor, eps: float
) -> torch.Tensor:
    """vLLM's lightning attention of ``hidden`` [batch, tokens, hidden] from a zero state,
    the recurrence taken token by token in float32."""
    batch, tokens, _ = hidden.shape
    qkv = F.silu(module.qkv_proj(hidden).float()).reshape(batch, tokens, heads, -1)
    q, k, v = qkv.chunk(3, dim=-1)
    decay = torch.exp(-slopes)[None, :, None, None]
    state = hidden.new_zeros(batch, heads, q.shape[-1], v.shape[-1], dtype=torch.float32)
    out = []
    for i in range(tokens):
        state = decay * state + k[:, i, :, :, None] * v[:, i, :, None, :]
        out.append((q[:, i, :, :, None] * state).sum(-2))
    o = torch.stack(out, dim=1).reshape(batch, tokens, -1)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * module.norm.weight.float()
    o = torch.sigmoid(module.output_gate(hidden).float()) * o
    return module.out_proj(o.to(hidden.dtype))
