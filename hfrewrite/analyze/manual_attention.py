"""Attention written out by hand (custom code): ``softmax(q @ k^T * scale + mask) @ v``,
possibly with an ALiBi bias (analyze/alibi.py).

Each softmax over the last dim whose probabilities (through casts) are multiplied with a
``v``, and whose scores come from one ``q @ k.transpose(-2, -1)`` (through a scale, a mask,
casts), is a candidate. It becomes the ``causal_sdpa`` attention leaf only when the traced
values prove it: torch's causal attention of ``q``, ``k`` and ``v`` (k and v before a GQA
expansion) at the default scale ``head_dim ** -0.5`` reproduces the traced output. A
bidirectional, windowed or otherwise masked attention, another scale, a softcap: no fold,
and the layer is refused as before ("no softmax attention call").
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from hfrewrite.analyze.alibi import proven_factor
from hfrewrite.analyze.trace import Traced, before_expansion, causal_sdpa, is_identity_dropout, value

_MATMUL = (torch.matmul, operator.matmul, "matmul")
_SOFTMAX = (torch.softmax, torch.nn.functional.softmax, "softmax")
_CASTS = ("to", "float", "type_as", "contiguous")
# (torch.max / clamp of the scores at a constant floor: the dtype minimum, Baichuan-13B)
_SCORE_STEPS = (
    operator.add,
    operator.mul,
    operator.truediv,
    torch.add,
    torch.mul,
    "masked_fill",
    torch.max,
    torch.maximum,
    "clamp",
    *_CASTS,
)


MANUAL_REASON = (
    "computes a softmax attention by hand that is not proven causal self-attention at the default scale "
    "(torch's causal SDPA of its q, k and v does not reproduce it)"
)


UNRECOGNISED_SOFTMAX_REASON = (
    "computes a softmax that is not recognised as attention (attention by hand is recognised as "
    "[batch, heads, seq, seq] scores from q @ k^T by matmul, a scale, a mask and possibly an ALiBi "
    "bias, then the probabilities @ v by matmul; scores in a [batch * heads] layout, einsum and "
    "bmm are not)"
)


def attends_by_hand(nodes, traced: Traced | None = None) -> bool:
    """Some node is a softmax with ``q @ k^T`` scores and a ``@ v`` (a fold candidate)."""
    return any(_is(n, _SOFTMAX) and _operands(n, traced) is not None for n in nodes)


def is_softmax(node) -> bool:
    return _is(node, _SOFTMAX)


def fold_manual_attention(traced: Traced) -> int:
    """Replace each proven hand-written attention by the leaf (its output's users then read
    the leaf's, in SDPA's layout); how many were folded."""
    graph, folded = traced.graph, 0
    for soft in [n for n in graph.nodes if _is(n, _SOFTMAX)]:
        found = _operands(soft, traced)
        if found is None:
            continue
        q, k, v, out, qk, scores = found
        heads = value(q).shape[1]
        k, v = before_expansion(k, heads), before_expansion(v, heads)
        if value(k).shape[1] != value(v).shape[1]:
            continue
        attended, _ = causal_sdpa(None, value(q), value(k), value(v), None)
        want = attended.transpose(1, 2)
        got = value(out)
        kwargs = {"scaling": None}
        # ALiBi first: a per-head linear bias (alibi.py), which a saturated softmax can hide
        expanded = [value(x) for x in found[1:3]]
        factor = (
            proven_factor(value(qk), value(scores), value(q), *expanded, got)
            if torch.is_tensor(got)
            else None
        )
        if factor is not None:
            kwargs["alibi"] = factor
        elif not (
            torch.is_tensor(got)
            and got.shape == want.shape
            and torch.allclose(got, want, rtol=1e-4, atol=1e-5)
        ):
            continue
        with graph.inserting_after(out):
            leaf = graph.call_function(causal_sdpa, (None, q, k, v, None), kwargs)
        with graph.inserting_after(leaf):
            first = graph.call_function(operator.getitem, (leaf, 0))
        with graph.inserting_after(first):
            back = graph.call_method("transpose", (first, 1, 2))
        # the traced values stay the source's (within the tolerance of SDPA's): what
        # follows was computed from them, and layout proofs compare exactly
        for node, val in ((leaf, (got.transpose(1, 2), None)), (first, got.transpose(1, 2)), (back, got)):
            node.meta.update(
                value=val,
                frames=out.meta.get("frames", ()),
                nn_module_stack=out.meta.get("nn_module_stack", {}),
            )
        out.replace_all_uses_with(back)
        folded += 1
    if folded:
        traced.graph_module.recompile()
    return folded


def _is(node: object, targets: tuple) -> bool:
    return isinstance(node, Node) and node.op in ("call_function", "call_method") and node.target in targets


def _operands(soft: Node, traced: Traced | None = None) -> tuple[Node, ...] | None:
    """(q, k, v, output, q @ k^T, scores) around a softmax over the last dim, or None."""
    scores = value(soft)
    dim = soft.kwargs.get("dim", soft.args[1] if len(soft.args) > 1 else None)
    if not (torch.is_tensor(scores) and scores.dim() == 4 and dim in (-1, 3)):
        return None
    probs = soft
    while len(probs.users) == 1 and (
        _is(nxt := next(iter(probs.users)), _CASTS)
        or (traced is not None and is_identity_dropout(nxt, traced))
    ):
        probs = nxt  # casts, and dropouts that returned their input (inference mode)
    users = list(probs.users)
    if len(users) != 1 or not _is(users[0], _MATMUL) or users[0].args[0] is not probs:
        return None
    out, v = users[0], users[0].args[1]
    node = soft.args[0]
    for _ in range(6):  # back over the scale, the mask and casts to q @ k^T
        if _is(node, _MATMUL):
            break
        if not _is(node, _SCORE_STEPS):
            return None
        shaped = [
            a for a in node.all_input_nodes if torch.is_tensor(value(a)) and value(a).shape == scores.shape
        ]
        if len(shaped) != 1:
            return None
        node = shaped[0]
    else:
        return None
    q, kt = node.args[:2]
    k = _untransposed(kt)
    operands = (q, k, v)
    if k is None or not all(
        isinstance(x, Node) and torch.is_tensor(value(x)) and value(x).dim() == 4 for x in operands
    ):
        return None
    return q, k, v, out, node, soft.args[0]


def _untransposed(kt: object) -> Node | None:
    """``k`` of ``k.transpose(-2, -1)`` (any spelling of the last two dims), else None."""
    if not _is(kt, ("transpose", torch.transpose)) or len(kt.args) != 3:
        return None
    dims = {d % 4 for d in kt.args[1:] if isinstance(d, int)}
    return kt.args[0] if dims == {2, 3} else None
