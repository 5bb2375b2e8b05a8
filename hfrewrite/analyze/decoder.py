"""Decoder-layer facts: its ordered residual blocks.

Pattern (pre-norm, llama family; gemma2/3 add a norm on each block's output)::

    residual = hidden; hidden = residual + [post_norm](self_attn(input_layernorm(hidden)))
    residual = hidden; hidden = residual + [post_norm](mlp(post_attention_layernorm(hidden)))

read backwards from the layer's output: each ``add(residual, branch)`` whose branch ends
in a direct submodule ``block`` that reads ``norm(residual)``, ``norm`` a norm submodule
(dtype casts of the stream, like mamba's ``residual.to(float32)``, are looked through).
vLLM fuses each ``residual + ...; norm(...)`` pair into ``norm(hidden, residual)``.

Preconditions (fail closed): the output is one tensor; every add on the residual stream
is such a block; the stream starts at the layer's first (hidden-states) input; apart
from layer inputs (position embeddings...), each block reads only its norm's output.

A layer that is not that (post norms, parallel blocks...) is carried from the source
(``carried_layer``): it names the one submodule that attends and the one MLP.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from hfrewrite.analyze.block_output import returns_tuple
from hfrewrite.analyze.leaf_modules import is_experts, is_norm
from hfrewrite.analyze.linear_classes import is_linear as computes_linear
from hfrewrite.analyze.manual_attention import no_attention_reason
from hfrewrite.analyze.plan import DecoderLayerPlan, NoMatch, ResidualBlock, refuse
from hfrewrite.analyze.trace import (
    Traced,
    is_attention_leaf,
    is_identity_dropout,
    scope_below,
    top_scope,
    value,
)

_ADD = (operator.add, torch.add, "add")
_CASTS = ("to", "float", "type_as", "contiguous")
PATTERN = "fused_residual_norm"


def analyze_decoder(traced: Traced) -> DecoderLayerPlan | NoMatch:
    """Residual blocks of a traced decoder layer, in execution order."""
    cls = type(traced.module).__name__
    (result,) = next(n for n in traced.graph.nodes if n.op == "output").args
    if isinstance(result, (tuple, list)) and result and all(map(_side_output, result[1:])):
        result = result[0]  # hidden states, then attention weights or nothing (Bamba's)
    if not isinstance(result, Node):
        return NoMatch(PATTERN, cls, "the layer does not return one hidden-states tensor")
    blocks: list[ResidualBlock] = []
    hidden = result
    while hidden.op != "placeholder":
        block = _residual_block(traced, hidden)
        if isinstance(block, str):
            return NoMatch(PATTERN, cls, block)
        blocks.insert(0, block[0])
        hidden = block[1]
    if hidden is not _first_placeholder(traced):
        return NoMatch(
            PATTERN,
            cls,
            f"the residual stream starts at {hidden.name}, not the hidden-states input",
        )
    if not blocks:
        return NoMatch(PATTERN, cls, "no residual block")
    return DecoderLayerPlan(cls, tuple(blocks), returns_tuple=returns_tuple(traced))


def _first_placeholder(traced: Traced) -> Node:
    return next(n for n in traced.graph.nodes if n.op == "placeholder")


def _residual_block(traced: Traced, node: Node) -> tuple[ResidualBlock, Node] | str:
    """(block, residual) for ``node = residual + block(norm(residual))``, or why not."""
    if not (
        node.op in ("call_function", "call_method")
        and node.target in _ADD
        and len(node.args) == 2
        and all(isinstance(a, Node) for a in node.args)
    ):
        return f"{node.name} on the residual stream is not `residual + block(...)`"
    why = None
    for residual, branch in (node.args, node.args[::-1]):  # either order (ERNIE-4.5: x + residual)
        branch = _past_dropouts(branch, traced)
        post = None
        if (
            isinstance(branch, Node)
            and branch.op == "call_module"
            and "." not in str(branch.target)
            and is_norm(traced.submodule(branch))
            and branch.args
            and isinstance(branch.args[0], Node)
        ):
            post, branch = (
                str(branch.target),
                _past_dropouts(_uncast(branch.args[0]), traced),
            )  # sandwich norm
        block = top_scope(branch)
        if block is None or block == top_scope(residual):
            continue
        nodes = traced.nodes_in(block)
        inside = set(nodes)
        reads = [  # what the block reads from outside itself, layer inputs aside
            a for n in nodes for a in n.all_input_nodes if a not in inside and a.op != "placeholder"
        ]
        reads = list(dict.fromkeys(reads))
        norm = reads[0] if len(reads) == 1 else None
        if (
            norm is not None
            and norm.op == "call_module"
            and is_norm(traced.submodule(norm))
            and _uncast(norm.args[0]) is _uncast(residual)
        ):
            return ResidualBlock(str(norm.target), block, post), _uncast(residual)
        names = ", ".join(a.name for a in reads)
        why = why or f"{block} does not read only a norm of the residual (it reads {names})"
    return why or f"{node.name} adds no submodule output to the residual stream"


def _side_output(returned: object) -> bool:
    """A layer output beside its hidden states that no layer reads: nothing, or what a block
    handed back besides its output (the attention weights)."""
    if returned is None:
        return True
    if not isinstance(returned, Node) or len(returned.users) != 1:
        return False
    source = returned.args[0] if returned.target is operator.getitem else returned
    return isinstance(source, Node) and top_scope(source) is not None


def _past_dropouts(node: object, traced: Traced) -> object:
    """Back through dropouts that returned their input (phi3's residual dropouts), and views
    that only regroup the tokens (Llama-4's ``mlp_out.view(residual.shape)`` of a block that
    flattened them): a view keeps the elements' order, so one that keeps the hidden size and
    the element count is the identity on vLLM's flat ``[tokens, hidden]`` states."""
    while isinstance(node, Node) and (is_identity_dropout(node, traced) or _token_view(node)):
        node = node.args[0]
    return node


def _token_view(node: Node) -> bool:
    source = node.args[0] if node.args else None
    if not (node.op == "call_method" and node.target in ("view", "reshape") and isinstance(source, Node)):
        return False
    before, after = value(source), value(node)
    return (
        torch.is_tensor(before)
        and before.dim() >= 2
        and after.dim() >= 2
        and before.shape[-1] == after.shape[-1]
        and before.numel() == after.numel()
    )


def _uncast(node: object) -> object:
    """``x`` for ``x.to(...)``, ``x.float()``...: casts keep the residual stream."""
    while isinstance(node, Node) and node.op == "call_method" and node.target in _CASTS:
        node = node.args[0]
    return node


def _parts_reason(traced: Traced, attending: set, others: list[str]) -> str:
    """Why a layer is not one attention and one MLP: its children named with their classes."""

    def named(paths) -> str:
        return ", ".join(f"{p} ({type(traced.module.get_submodule(p)).__name__})" for p in sorted(paths))

    if None in attending:
        return "the layer calls its attention in its own forward, not in a child module"
    if len(attending) > 1:
        return (
            f"{len(attending)} children attend ({named(attending)}): the analysis proves one attention "
            "per layer"
        )
    beside = f"beside the attention in {named(attending)}"
    if not others:
        return f"no child {beside} holds linears (no MLP)"
    return f"{len(others)} children {beside} hold linears ({named(others)}): the analysis proves one MLP"


def carried_layer(traced: Traced, mixer: str = "") -> DecoderLayerPlan:
    """A layer whose forward is carried: which direct submodule attends (it holds the
    attention call, or is a hybrid model's other ``mixer``) and which is the MLP (the other
    one with linears; a MoE block beside a dense MLP, the two summed: the MoE). A ``mixer``
    beside the attention (Falcon-H1's Mamba-2 in every layer) is neither."""
    attention = {top_scope(n) for n in traced.graph.nodes if is_attention_leaf(n)}
    beside = mixer if attention else ""
    attending = attention or ({mixer} if mixer else set())
    with_linears = {top_scope(n) for n in traced.linears_in("")}
    moe = {
        top_scope(n) for n in traced.graph.nodes if n.op == "call_module" and is_experts(traced.submodule(n))
    }
    with_linears |= moe
    cls = type(traced.module).__name__
    others = sorted(with_linears - attending - {None, beside})
    shared = [o for o in others if o not in moe] if len(others) == 2 and len(moe & set(others)) == 1 else []
    others = [o for o in others if o not in shared]
    if not attending:
        refuse("decoder_layer", no_attention_reason(traced.graph.nodes, traced), cls)
    inline = _inline_mlp(traced, others)
    if len(attending) != 1 or None in attending or (len(others) != 1 and not inline):
        refuse("decoder_layer", _parts_reason(traced, attending, others), cls)
    path, wrappers = attending.pop(), []
    while (inner := _wrapped_attention(traced, path)) is not None:
        wrappers.append(type(traced.module.get_submodule(path)).__name__)
        path = inner
    return DecoderLayerPlan(
        cls,
        (),
        attention_block=path,
        mlp_block="" if inline else others[0],
        mlp_linears=inline,
        shared_mlp_block=shared[0] if shared else "",
        attention_returns_tuple=traced.returns_tuple.get(path, True),
        attention_returns_list=traced.returns_list.get(path, False),
        attention_wrappers=tuple(wrappers),
        returns_tuple=returns_tuple(traced),
        mixer_block=beside,
    )


def _inline_mlp(traced: Traced, others: list[str]) -> tuple[str, ...]:
    """The layer's own two Linears (OPT's and BioGPT's ``fc1``, ``fc2``), when they are all
    it holds besides its attention: an MLP written into the layer (else ())."""
    if len(others) != 2:
        return ()
    linears = [traced.module.get_submodule(name) for name in others]
    return tuple(others) if all(computes_linear(m) for m in linears) else ()


def _wrapped_attention(traced: Traced, path: str) -> str | None:
    """The child of ``path`` that holds its attention call and every one of its linears,
    when ``path`` only wraps it (dbrx's norm_attn_norm: two norms around ``attn``); else None."""
    calls = [n for n in traced.nodes_in(path) if is_attention_leaf(n)]
    inner = {scope_below(n, path) for n in [*calls, *traced.linears_in(path)]}
    return inner.pop() if len(inner) == 1 and None not in inner else None
