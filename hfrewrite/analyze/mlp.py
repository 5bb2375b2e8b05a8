"""MLP facts: the gated ``down(act(gate(x)) * up(x))`` block.

Pattern (llama family): ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, which vLLM
writes as ``down_proj(act_and_mul(gate_up_proj(x)))``; or, without a gate (starcoder2,
nemotron), ``down(act(up(x)))`` with an elementwise act, which vLLM shards as
``RowParallelLinear(act(ColumnParallelLinear(x)))``.

Preconditions (fail closed): the block has three Linears, each called once; its one
output is a Linear (down) reading a product ``act(gate(x)) * up(x)``; gate and up read
the same x and have equal out_features and bias; act is called on the gate alone and is
either a module attribute of the block, of the class transformers builds for the config's
activation, or torch's own ``silu``/``gelu`` function (custom code), computing vLLM's
formula for it on the traced values; and vLLM has an ``*AndMul`` for it. Otherwise, a
gate and up whose act is proven lane-wise per gate/up pair keep the source's act between
column-sharded projections (:mod:`hfrewrite.analyze.mlp_pairwise`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.fx import Node
from transformers.activations import ACT2FN

from hfrewrite.analyze.block_output import adds_given_tensor, read_outputs
from hfrewrite.analyze.dataflow import ancestors, path_nodes
from hfrewrite.analyze.fused_qkv import forward_code, source_line
from hfrewrite.analyze.leaf_modules import is_norm
from hfrewrite.analyze.mlp_forms import MlpForm
from hfrewrite.analyze.mlp_pairwise import OWN_ACT, function_of, lanewise, pairwise_fused, pairwise_separate
from hfrewrite.analyze.output_norm import normalises_each_token
from hfrewrite.analyze.plan import LinearFact, MlpPlan, NoMatch
from hfrewrite.analyze.q_prescale import factor_of
from hfrewrite.analyze.trace import Traced, is_identity_dropout, past_identity_dropouts, relative, value

# Keys of vllm.model_executor.layers.activation._ACTIVATION_AND_MUL_REGISTRY (vLLM 0.32)
# whose math is ``act(gate) * up``; "swigluoai" (clamped, gpt-oss) and "geglu" (no
# transformers ACT2FN entry) are left out. Hard-coded so analysis does not import vLLM.
ACT_AND_MUL = ("gelu", "gelu_pytorch_tanh", "silu", "swish")
# What each of those computes on the gate half in vLLM's kernel, replayed on the traced values.
_VLLM_ACT = {
    "gelu": torch.nn.functional.gelu,
    "gelu_pytorch_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "silu": torch.nn.functional.silu,
    "swish": torch.nn.functional.silu,
}

# torch's activation functions (custom code calls them directly) -> vLLM's name for them
_FUNCTIONAL = {torch.nn.functional.silu: "silu", torch.nn.functional.gelu: "gelu"}

_MUL = (operator.mul, torch.mul, "mul")
_SLICING = (operator.getitem, "chunk", "split", torch.chunk, torch.split)
PATTERN = "fuse_gate_up"


def analyze_mlp(traced: Traced, path: str, config, container: bool = False) -> MlpPlan | NoMatch:
    """Facts of the MLP submodule ``path`` of a model built from ``config``; a torch container
    (no class of the source) only with ``container`` (analyze/carried_mlp.py)."""
    cls = type(traced.module.get_submodule(path)).__name__
    if torch_container(traced.module.get_submodule(path)) and not container:
        return NoMatch(
            PATTERN,
            cls,
            "a torch container the source builds (CTRL's nn.Sequential): no class of its own to rewrite",
        )
    linears = traced.linears_in(path)
    names = [relative(n.target, path) for n in linears]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        return NoMatch(PATTERN, cls, f"{', '.join(repeated)} called more than once")
    ends = {past_identity_dropouts(n, traced, path): n for n in linears}
    outputs = read_outputs(traced, path)
    adds_residual = False
    if (
        len(outputs) == 1
        and outputs[0] not in ends
        and (scaled := _scaled_output(traced, path, outputs[0], ends))
    ):
        outputs = [scaled]  # `down(y) * self.down_multiplier` (Falcon-H1): the forward keeps it
    if len(outputs) == 1 and outputs[0] not in ends:  # `down(...) + residual` (BLOOM)
        given = [end for end in ends if adds_given_tensor(outputs[0], end, traced, path)]
        outputs, adds_residual = (given, True) if given else (outputs, False)
    if len(outputs) != 1 or outputs[0] not in ends:
        return NoMatch(PATTERN, cls, "the block output is not one linear projection")
    down = ends[outputs[0]]
    if adds_residual and len(linears) == 2:  # the rewrites keep the forward's add as written
        return _ungated(traced, path, cls, linears, down)
    if len(linears) == 2:
        fused = _fused_gate_up(traced, path, cls, linears, down, config)
        if isinstance(fused, MlpPlan):
            return fused
        ungated = _ungated(traced, path, cls, linears, down)
        if isinstance(ungated, MlpPlan):
            return ungated
        return pairwise_fused(traced, path, cls, linears, down) or fused or ungated
    if len(linears) != 3:
        return NoMatch(PATTERN, cls, f"{len(linears)} linears instead of gate, up and down")
    reader, norm = _inner_norm(traced, path, down)
    product = _gated_product(path, cls, linears, down, reader.args[0])
    gated = product if isinstance(product, NoMatch) else _gated(traced, path, cls, product, down, config)
    if isinstance(gated, MlpPlan):
        return replace(gated, inner_norm=norm)
    pairwise = pairwise_separate(traced, path, cls, linears, down, reader)
    return replace(pairwise, inner_norm=norm) if pairwise else gated


def _scaled_output(traced: Traced, path: str, output: Node, ends: dict) -> Node | None:
    """The projection ``output`` multiplies by a number that the source's expression on that
    line gives (``self.down_multiplier``), where nothing else reads the projection: the
    rewrites keep the forward's own line, which goes on multiplying vLLM's reduced output."""
    projection = next((a for a in output.args if a in ends), None) if isinstance(output, Node) else None
    if projection is None or output.target not in _MUL or len(projection.users) != 1:
        return None
    line = source_line(output, forward_code(traced, path))
    return projection if factor_of(output, line, traced.module.get_submodule(path)) else None


def analyze_inline_mlp(traced: Traced, attrs: tuple[str, ...]) -> MlpPlan | NoMatch:
    """Facts of an ungated MLP written into the layer itself (OPT's and BioGPT's
    ``fc2(act(fc1(x)))``): the layer's Linears ``attrs``, each called once, one reading the
    other through an elementwise act whose value nothing else reads (vLLM shards that
    intermediate by columns)."""
    cls = type(traced.module).__name__
    linears = [n for n in traced.linears_in("") if n.target in attrs]
    if sorted(n.target for n in linears) != sorted(attrs):
        return NoMatch(PATTERN, cls, f"{', '.join(attrs)} are not each called once")
    downs = [n for n in linears if any(other in ancestors(n, None) for other in linears if other is not n)]
    if len(downs) != 1:
        return NoMatch(PATTERN, cls, f"{' and '.join(attrs)} do not form up -> act -> down")
    down = downs[0]
    (up,) = [n for n in linears if n is not down]
    between = set(path_nodes(down, up, None))
    if not between or any(not set(n.users) <= between | {down} for n in [up, *between]):
        return NoMatch(
            PATTERN,
            cls,
            f"the layer reads {up.target}'s output other than through the act into {down.target}",
        )
    act = down.args[0]
    while is_identity_dropout(act, traced):  # (BioGPT's activation dropout)
        act = act.args[0]
    return _ungated(traced, "", cls, linears, down, act)


@dataclass(frozen=True)
class _GatedProduct:
    """``act(gate(x)) * up(x)`` in the graph: the activation's call and the two projections."""

    act: Node
    gate: Node
    up: Node


def _inner_norm(traced: Traced, path: str, down: Node) -> tuple[Node, str | None]:
    """What reads the intermediate: a norm over all of it that ``down`` reads (BitNet's
    ``down(ffn_sub_norm(act(gate(x)) * up(x)))``) and its attribute, the norm proven to read
    a value nothing else reads and to normalise each token alone, so that the file can
    gather the ranks' columns before it; else ``down`` itself and None."""
    norm = down.args[0] if down.args else None
    if not (isinstance(norm, Node) and norm.op == "call_module" and is_norm(traced.submodule(norm))):
        return down, None
    given = norm.args[0] if norm.args else None
    if (
        isinstance(given, Node)
        and len(given.users) == 1
        and len(norm.users) == 1
        and torch.is_tensor(value(given))
        and normalises_each_token(traced.submodule(norm), value(given), value(norm))
    ):
        return norm, relative(norm.target, path)
    return down, None


def _gated_product(path: str, cls: str, linears: list, down: Node, product) -> _GatedProduct | NoMatch:
    """The ``act(gate(x)) * up(x)`` that ``down`` reads (``product``, past an inner norm),
    gate and up two of ``linears``."""
    if not (
        isinstance(product, Node)
        and product.op in ("call_function", "call_method")
        and product.target in _MUL
        and len(product.args) == 2
        and not product.kwargs
    ):
        return NoMatch(
            PATTERN,
            cls,
            f"{relative(down.target, path)} does not read a product of two",
        )
    for act, up in (product.args, product.args[::-1]):
        if (
            (_is_act_module_call(act) or _functional_activation(act))
            and act.args[0] in linears
            and up in linears
            and act.args[0] is not up
        ):
            gate = act.args[0]
            break
    else:
        return NoMatch(PATTERN, cls, "the product is not act(linear(x)) * linear(x)")
    if gate.args[0] is not up.args[0]:
        return NoMatch(PATTERN, cls, "gate and up projections read different inputs")
    return _GatedProduct(act, gate, up)


def _gated(
    traced: Traced, path: str, cls: str, product: _GatedProduct, down: Node, config
) -> MlpPlan | NoMatch:
    """The plan of ``down(act(gate(x)) * up(x))``: gate and up alike, and an activation
    vLLM has an ``*AndMul`` for, computing its formula on the traced values."""
    act, gate, up = product.act, product.gate, product.up
    g, u, d = (traced.linear_fact(n, path) for n in (gate, up, down))
    if g.out_features != u.out_features or g.bias != u.bias:
        return NoMatch(PATTERN, cls, f"{g.attr} and {u.attr} differ in out_features or bias")
    if act.op == "call_module":
        activation, act_attr = _config_activation(traced.submodule(act), config), relative(act.target, path)
    else:  # torch's own function, called in forward: no attribute holds it
        activation, act_attr = _functional_activation(act), ""
    if activation not in ACT_AND_MUL:
        return NoMatch(PATTERN, cls, f"vLLM has no fused *AndMul for activation {activation!r}")
    if not _computes(act, gate, activation):
        return NoMatch(
            PATTERN,
            cls,
            f"{act_attr or act.target.__name__} does not compute {activation} (replayed on the traced values)",
        )
    return MlpPlan(cls, g, u, d, act_attr, activation)


def _is_act_module_call(act: object) -> bool:
    return isinstance(act, Node) and act.op == "call_module" and len(act.args) == 1 and not act.kwargs


def _functional_activation(act: object) -> str:
    """The vLLM name of torch's activation function ``act`` calls on one input, or ""."""
    if not (isinstance(act, Node) and act.op == "call_function" and len(act.args) == 1):
        return ""
    name = _FUNCTIONAL.get(act.target, "")
    kwargs = dict(act.kwargs)
    if kwargs.pop("inplace", False) is not False:
        return ""
    approximate = kwargs.pop("approximate", "none") if name == "gelu" else "none"
    if kwargs:
        return ""
    return {"none": name, "tanh": "gelu_pytorch_tanh"}.get(approximate, "")


def _fused_gate_up(traced: Traced, path: str, cls: str, linears: list, down: Node, config) -> MlpPlan | None:
    """``down(act(g) * u)`` where g and u are the two halves of one Linear's output (the
    checkpoint-fused ``gate_up_proj`` of phi3 and glm), which ``MergedColumnParallelLinear``
    loads from one tensor; None when the block is not that."""
    (proj,) = [n for n in linears if n is not down]
    product = down.args[0]
    if not (
        isinstance(product, Node)
        and product.op in ("call_function", "call_method")
        and product.target in _MUL
        and len(product.args) == 2
    ):
        return None
    if proj.args[0] in set(traced.nodes_in(path)):
        return None  # the block transforms its input first: the rebuilt forward would not
    whole = value(proj)
    half = whole.shape[-1] // 2
    for act, up in (product.args, product.args[::-1]):
        functional = _functional_activation(act)  # ChatGLM's swiglu: F.silu(x[0]) * x[1]
        if not ((_is_act_module_call(act) or functional) and isinstance(up, Node)):
            continue
        gate = act.args[0]
        if not (_only_from(gate, proj) and _only_from(up, proj)):
            continue
        if torch.equal(value(gate), whole[..., :half]) and torch.equal(value(up), whole[..., half:]):
            fact = traced.linear_fact(proj, path)
            fact = LinearFact(fact.attr, fact.in_features, half, fact.bias)
            activation = functional or _config_activation(traced.submodule(act), config)
            if activation not in ACT_AND_MUL:
                return NoMatch(
                    PATTERN,
                    cls,
                    f"vLLM has no fused *AndMul for activation {activation!r}",
                )
            if not _computes(act, gate, activation):
                return NoMatch(
                    PATTERN,
                    cls,
                    f"{relative(act.target, path)} does not compute {activation} "
                    "(replayed on the traced values)",
                )
            d = traced.linear_fact(down, path)
            act_attr = "" if functional else relative(act.target, path)  # "": torch's function
            return MlpPlan(cls, fact, fact, d, act_attr, activation, fused_gate_up=True)
    return None


def _computes(act: Node, gate: Node, activation: str) -> bool:
    """The activation module's traced output is vLLM's ``activation`` of its input."""
    out, x = value(act), value(gate)
    return (
        torch.is_tensor(out)
        and torch.is_tensor(x)
        and out.shape == x.shape
        and torch.allclose(out, _VLLM_ACT[activation](x), rtol=1e-5, atol=1e-6)
    )


def _only_from(node: Node, source: Node) -> bool:
    """``node`` is computed from ``source`` alone, by indexing and splitting it."""
    while node is not source:
        tensors = node.all_input_nodes
        if (
            len(tensors) != 1
            or node.op not in ("call_function", "call_method")
            or node.target not in _SLICING
        ):
            return False
        node = tensors[0]
    return True


_TORCH_ACTIVATIONS = {nn.SiLU: "silu", nn.ReLU: "relu"}


def _config_activation(module, config) -> str:
    """The config value that names ``module``'s activation (``hidden_act``,
    ``hidden_activation``...: whichever string field ACT2FN maps to its class), or ""."""
    for key, val in sorted(config.to_dict().items()):
        if isinstance(val, str) and val in ACT2FN and type(ACT2FN[val]) is type(module):
            return val
    # torch's own activation modules (custom code's ``nn.SiLU()``); _computes replays them
    if isinstance(module, nn.GELU):
        return "gelu_pytorch_tanh" if module.approximate == "tanh" else "gelu"
    return _TORCH_ACTIVATIONS.get(type(module), "")


def _ungated(
    traced: Traced, path: str, cls: str, linears: list, down: Node, act: Node | None = None
) -> MlpPlan | NoMatch:
    """``down(act(up(x)))``: vLLM shards ``up`` by columns and ``down`` by rows, which
    holds when act is elementwise (checked on the traced values: act of a column slice
    is the slice of act); ``act``: where down reads it through identity dropouts."""
    (up,) = [n for n in linears if n is not down]
    act = down.args[0] if act is None else act
    functional = _functional_activation(act)
    module = _is_act_module_call(act) and not functional
    if (module or functional) and act.args[0] is up:
        fn = traced.submodule(act) if module else lambda t: act.target(t, **act.kwargs)
        name = relative(act.target, path) if module else functional
    elif (fn := function_of(traced, (up,), act)) is not None:  # written out (BLOOM's tanh gelu)
        name = "the activation written out"
    else:
        return NoMatch(
            PATTERN,
            cls,
            f"{relative(down.target, path)} does not read act({relative(up.target, path)}(x))",
        )
    x = value(up)
    # each block of columns at 2 and 4 ranks replays to its block (a gated function,
    # chunked in two, halves its width and fails)
    if not lanewise(lambda cols: fn(x[..., cols]), value(act), x.shape[-1]):
        return NoMatch(PATTERN, cls, f"{name} is not elementwise")
    u, d = traced.linear_fact(up, path), traced.linear_fact(down, path)
    if module:
        return MlpPlan(cls, None, u, d, name, type(traced.submodule(act)).__name__, form=MlpForm.UNGATED)
    # torch's function called inline, or the math written out: the source's code stays
    return MlpPlan(cls, None, u, d, "", functional or OWN_ACT, form=MlpForm.UNGATED)


def torch_container(module) -> bool:
    """``module`` is one of torch's own classes (``nn.Sequential``), not the source's."""
    return type(module).__module__.startswith("torch.")
