"""Prove an attention's output gate (analyze/output_gates.py) on the traced graph and values.

Pattern (AFMoE, Laguna)::

    out = attention(q, k, v)                       # [b, s, heads, head_dim]
    out = out.reshape(b, s, -1) * act(g_proj(x))   # or per head: [b, s, heads, 1]
    return o_proj(out)

Structure: exactly one multiplication on the path from the attention call to the output
projection; its other operand is computed from one Linear reading the block's input (the
one q, k and v read) and from nothing else the block holds. Values: the input the output
projection read equals the replay of one row of the table on the traced values.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.fx import Node

from hfrewrite.analyze.dataflow import linears_feeding, path_nodes
from hfrewrite.analyze.output_gates import GateActivation, OutputGate
from hfrewrite.analyze.plan import refuse
from hfrewrite.analyze.trace import Traced, relative, value

_PASS = "vllm_attention"


def output_gate(
    traced: Traced,
    path: str,
    scope: set[Node],
    call: Node,
    o_node: Node,
    qkv_linears: list[Node],
    heads: tuple[int, int],
    packed_q: Node | None = None,
) -> tuple[OutputGate | None, list[Node]]:
    """The gate between the attention output and its projection (None without a product on
    that path), and the path's other nodes, for the caller's layout check; ``qkv_linears``:
    the Linears q, k and v come from; ``heads``: (heads, head_dim); ``packed_q``: q's Linear
    where it projects twice the heads (the gate may be the second half of each)."""
    on_path = path_nodes(o_node, call, scope)
    products = [n for n in on_path if _multiplies(n) and torch.is_tensor(value(n))]  # not sizes
    if not products:
        return None, on_path
    if len(products) > 1:
        refuse(_PASS, f"the attention output is multiplied {len(products)} times before its projection")
    product = products[0]
    operands = [a for a in product.all_input_nodes if a is not call and a not in on_path]
    linear = _gate_linear(traced, scope, operands, qkv_linears, packed_q)
    between = [*path_nodes(operands[0], linear, scope), operands[0]]
    if any(
        a not in (*between, linear) and torch.is_tensor(value(a)) for n in between for a in n.all_input_nodes
    ):
        refuse(_PASS, "the output gate reads a tensor besides its projection of the block's input")
    packed = linear is packed_q
    activation, per_head = _replayed(traced, call, o_node, linear, heads, packed)
    module = traced.submodule(linear)
    gate = OutputGate(
        attr=relative(linear.target, path),
        in_features=module.in_features,
        out_features=module.out_features,
        bias=module.bias is not None,
        activation=activation,
        per_head=per_head,
        upcast=any(_to_float32(n) for n in between),
        packed=packed,
    )
    rest = [n for n in on_path if n is not product and torch.is_tensor(value(n))]
    return gate, rest


def _gate_linear(
    traced: Traced, scope: set[Node], operands: list[Node], qkv_linears: list[Node], packed_q: Node | None
) -> Node:
    """The one Linear the gate operand comes from: a projection of q's, k's and v's input
    (q's own where it packs the gate beside q: ``packed_q``)."""
    found = linears_feeding(operands[0], scope, traced) if len(operands) == 1 else []
    reads = {n.args[0] for n in qkv_linears}
    if len(found) == 1 and found[0] is packed_q is not None:
        return found[0]
    if len(found) != 1 or found[0] in qkv_linears or found[0].args[0] not in reads:
        refuse(
            _PASS,
            "the attention output is multiplied by something other than a gate projected from the block's input",
        )
    return found[0]


def _replayed(
    traced: Traced, call: Node, o_node: Node, linear: Node, heads: tuple[int, int], packed: bool
) -> tuple[GateActivation, bool]:
    """The row whose replay gives what the output projection read, and whether per head
    (``packed``: the gate is the second half of each head of the projection)."""
    num_heads, head_dim = heads
    out = value(call)
    out = out[0] if isinstance(out, (tuple, list)) else out
    got = value(o_node.args[0])
    module = traced.submodule(linear)
    if not (torch.is_tensor(out) and out.dim() == 4):
        refuse(_PASS, "the attention output is not [batch, seq, heads, head_dim]")
    if module.out_features not in (num_heads, num_heads * head_dim) and not packed:
        refuse(
            _PASS, f"the output gate has {module.out_features} lanes: neither one per head nor one per lane"
        )
    per_head = module.out_features == num_heads
    batch, seq = out.shape[:2]
    by_head = out.reshape(batch, seq, num_heads, head_dim)
    with torch.no_grad():
        gate = F.linear(value(linear.args[0]), module.weight, module.bias)
    if packed:  # [heads, q then gate]: the second half of each head
        gate = gate.reshape(batch, seq, num_heads, 2 * head_dim)[..., head_dim:].reshape(batch, seq, -1)
    worst = float("inf")
    for row in GateActivation:
        scale = row.replay(gate)
        want = (by_head * scale[..., None] if per_head else by_head.reshape(batch, seq, -1) * scale).reshape(
            batch, seq, -1
        )
        if got.shape != want.shape:
            refuse(_PASS, "the output projection does not read the gated attention output per token")
        diff = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
        if diff <= 1e-5:
            return row, per_head
        worst = min(worst, diff)
    labels = ", ".join(row.label for row in GateActivation)
    refuse(_PASS, f"replaying the output gate as {labels} differs from the block by {worst:.2e}")


def _multiplies(node: Node) -> bool:
    return (node.op == "call_function" and node.target in (operator.mul, torch.mul)) or (
        node.op == "call_method" and node.target == "mul"
    )


def _to_float32(node: Node) -> bool:
    if node.op != "call_method":
        return False
    return node.target == "float" or (
        node.target == "to" and torch.float32 in (*node.args[1:], *node.kwargs.values())
    )
