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
from typing import NamedTuple

import torch
from torch.fx import Node

from hfrewrite.analyze.alibi import proven_factor
from hfrewrite.analyze.attention_calls import AttentionCall
from hfrewrite.analyze.gqa_expansion import before_expansion
from hfrewrite.analyze.mask_window import mask_buffer, proven_band
from hfrewrite.analyze.plan import refuse
from hfrewrite.analyze.trace import (
    DIRECT_SDPA_REASON,
    Traced,
    causal_sdpa,
    is_direct_sdpa,
    is_identity_dropout,
    relative,
    value,
)
from hfrewrite.analyze.unconverted_mixers import unconverted_mixer

_MATMUL = (torch.matmul, operator.matmul, "matmul", torch.bmm, "bmm")
# ``bias.baddbmm(q, k^T, beta=, alpha=)``: BLOOM's ALiBi scores, bias + alpha * q @ k^T
_BADDBMM = (torch.baddbmm, "baddbmm")
_SOFTMAX = (torch.softmax, torch.nn.functional.softmax, "softmax")
_CASTS = ("to", "float", "type_as", "contiguous")
_RESHAPES = ("view", "reshape", torch.reshape)
_SCALES = (operator.mul, operator.truediv, torch.mul, torch.div, "mul", "div")
# (torch.max / clamp of the scores at a constant floor: the dtype minimum, Baichuan-13B)
_SCORE_STEPS = (
    operator.add,
    operator.mul,
    operator.truediv,
    torch.add,
    torch.mul,
    "masked_fill",
    torch.masked_fill,
    torch.where,  # selected by a boolean mask (GPT-Neo's buffer): analyze/mask_window.py
    torch.max,
    torch.maximum,
    "clamp",
    *_CASTS,
)


MANUAL_REASON = (
    "computes a softmax attention by hand that is not proven causal self-attention at the default scale "
    "(torch's causal SDPA of its q, k and v does not reproduce it)"
)


NO_MIXER_REASON = (
    "no softmax attention call, and the block is no mixer hfrewrite proves one of vLLM's layers "
    "(a gated short convolution: ShortConv; a Mamba-2 block: MambaMixer2; a Mamba-1 block: "
    "MambaMixer; a gated delta net laid out as Qwen3.5's or Qwen3-Next's: "
    "QwenGatedDeltaNetAttention, or as OLMo-hybrid's: OlmoHybridGatedDeltaNetAttention): a "
    "linear-attention or other "
    "recurrent mixer is not converted"
)


UNRECOGNISED_SOFTMAX_REASON = (
    "computes a softmax that is not recognised as attention (attention by hand is recognised as "
    "q @ k^T scores per head (matmul over [batch, heads], or bmm/baddbmm/einsum over "
    "[batch * heads]), a scale, a causal mask and possibly an ALiBi bias, then the "
    "probabilities @ v; other forms are not)"
)


def _is_product(node: object) -> bool:
    """A batched ``a @ b``: matmul, bmm, or an einsum that spells one (``bik,bkj->bij``)."""
    return _is(node, _MATMUL) or _einsum_operands(node) is not None


def _einsum_operands(node: object) -> tuple[Node, Node] | None:
    """(a, b) of ``torch.einsum("...ik,...kj->...ij", a, b)`` (any letters, the same batch
    letters on all three), else None."""
    if not _is(node, (torch.einsum, "einsum")) or not node.args or not isinstance(node.args[0], str):
        return None
    operands = node.args[1:]
    if len(operands) == 1 and isinstance(operands[0], list | tuple):
        operands = tuple(operands[0])
    spec = node.args[0].replace(" ", "")
    if len(operands) != 2 or spec.count("->") != 1 or spec.count(",") != 1:
        return None
    inputs, out = spec.split("->")
    a, b = inputs.split(",")
    if len(a) < 2 or len(a) != len(b) or len(a) != len(out) or len(set(a + b)) != len(a) + 1:
        return None
    batch, (i, k), (k2, j) = a[:-2], a[-2:], b[-2:]
    if b[:-2] != batch or k != k2 or out != batch + i + j or len({i, k, j}) != 3:
        return None
    return operands[0], operands[1]


def attends_by_hand(nodes, traced: Traced | None = None) -> bool:
    """Some node is a softmax with ``q @ k^T`` scores and a ``@ v`` (a fold candidate)."""
    return any(_is(n, _SOFTMAX) and _operands(n, traced) is not None for n in nodes)


def is_softmax(node) -> bool:
    return _is(node, _SOFTMAX)


def scores_softmax(node) -> bool:
    """A softmax whose input comes, within a few ops, from ``a @ b`` of two computed values
    (scores: an attention form, recognised or not), unlike a router's softmax over a
    linear's logits."""
    if not _is(node, _SOFTMAX):
        return False
    frontier, seen = [node.args[0]], set()
    for _ in range(6):
        inputs = [n for n in frontier if isinstance(n, Node) and n not in seen]
        seen.update(inputs)
        if any(_is_product(n) or _is(n, _BADDBMM) for n in inputs if _computed_operands(n)):
            return True
        frontier = [a for n in inputs if n.op in ("call_function", "call_method") for a in n.all_input_nodes]
    return False


def no_attention_reason(nodes, traced: Traced) -> str:
    """Why ``nodes`` (a layer's, or a block's), holding no attention call, hold no attention
    the file could compute: the form they compute instead, a mixer vLLM has a layer for that
    cannot run here (analyze/unconverted_mixers.py), else that no mixer is proven."""
    nodes = list(nodes)
    if any(is_direct_sdpa(n) for n in nodes):
        return DIRECT_SDPA_REASON
    if attends_by_hand(nodes, traced):
        return MANUAL_REASON
    if any(scores_softmax(n) for n in nodes):
        return UNRECOGNISED_SOFTMAX_REASON
    return unconverted_mixer(traced.module) or NO_MIXER_REASON


def _computed_operands(node: Node) -> bool:
    """No operand of the product is a parameter or buffer (``x @ W`` is a projection)."""
    return not any(a.op == "get_attr" for a in node.all_input_nodes)


def fold_manual_attention(traced: Traced) -> int:
    """Replace each proven hand-written attention by the leaf (its output's users then read
    the leaf's, in SDPA's layout); how many were folded."""
    graph, folded = traced.graph, 0
    per_head_softmax(graph)
    for soft in [n for n in graph.nodes if _is(n, _SOFTMAX)]:
        found = _operands(soft, traced, make_k=True)
        if found is None:
            continue
        if value(found[0]).dim() == 3:  # heads flattened into the batch: [b * heads, s, d]
            found = _unflattened(graph, found)
        q, k, v, out, qk, scores = found
        heads = value(q).shape[1]
        k, v = before_expansion(k, heads), before_expansion(v, heads)
        if value(k).shape[1] != value(v).shape[1]:
            continue
        got = value(out)
        # ALiBi first: a per-head linear bias (alibi.py), which a saturated softmax can hide
        expanded = [value(x) for x in found[1:3]]
        factor = proven_factor(qk, value(scores), value(q), *expanded, got) if torch.is_tensor(got) else None
        if factor is not None:
            proven = _Proven(q, {"scaling": None, "alibi": factor}, None, False)
        else:
            proven = _proven_options(soft, q, k, v, got, traced)
            if proven is None:
                continue
        with graph.inserting_after(out):
            leaf = graph.call_function(causal_sdpa, (None, proven.q, k, v, None), proven.kwargs)
        leaf.meta["by_hand"] = True  # (a scale it carries is refused unless MLA names it)
        leaf.meta["window_mask"] = proven.window_mask  # (the buffer the file reads each window off)
        leaf.meta["unscaled"] = proven.unscaled
        with graph.inserting_after(leaf):
            first = graph.call_function(operator.getitem, (leaf, 0))
        with graph.inserting_after(first):
            back = graph.call_method("transpose", (first, 1, 2))
        # the traced values stay the source's (within the tolerance of SDPA's): what
        # follows was computed from them, and layout proofs compare exactly
        steps = [(leaf, (got.transpose(1, 2), None)), (first, got.transpose(1, 2)), (back, got)]
        source_out = out.meta.get("flat_from", out)  # the [b * heads, s, d] matmul, when flat
        if source_out is not out:
            with graph.inserting_after(back):
                flat = graph.call_method("reshape", (back, *value(source_out).shape))
            steps.append((flat, value(source_out)))
            back = flat
        for node, val in steps:
            _copy_meta(node, source_out, val)
        # (the per-head view of a flat output keeps reading it: it feeds the leaf)
        source_out.replace_all_uses_with(back, delete_user_cb=lambda user, out=out: user is not out)
        folded += 1
    for node in [n for n in graph.nodes if n.meta.get("made_k") and not n.users]:
        graph.erase_node(node)
    if folded:
        traced.graph_module.recompile()
    return folded


class _Proven(NamedTuple):
    q: Node  # as the leaf reads it
    kwargs: dict  # the leaf's
    window_mask: str | None  # the target of the mask buffer the window is read from
    unscaled: bool  # the scores are not scaled at all: the leaf carries 1.0


def _proven_options(soft: Node, q: Node, k: Node, v: Node, got, traced: Traced) -> _Proven | None:
    """What makes causal SDPA reproduce ``got``, else None. Tried:
    the default scale, applied to the scores or to q before its product (ERNIE-4.5: q /
    sqrt(head_dim)); another constant multiplying the scores (DeepSeek's softmax_scale with
    YaRN's mscale: the leaf carries it, and only MLA accepts one, a named attribute); no
    scale at all (GPT-Neo: the leaf carries 1.0). Each at every window where the scores are
    selected by a boolean buffer of the module proven a causal band (analyze/mask_window.py),
    else causal alone."""
    steps = _score_steps(soft)[0]
    held = mask_buffer(steps, traced.module)
    buffer = traced.module.get_buffer(held) if held else None
    length = value(q).shape[-2]
    windows = (None, *range(1, length)) if held else (None,)
    scale = _score_scale(soft)
    unscaled_scores = scale is None and not any(_is(n, _SCALES) for n in steps)
    scale = 1.0 if unscaled_scores else scale
    for window in windows:
        if held and not proven_band(buffer, window):
            continue
        unscaled = next((x for x in (q, _unscaled(q)) if _reproduces(x, k, v, got, None, window)), None)
        if unscaled is not None:
            return _Proven(unscaled, {"scaling": None, "sliding_window": window}, held, False)
        if scale is not None and _reproduces(q, k, v, got, scale, window):
            return _Proven(q, {"scaling": scale, "sliding_window": window}, held, unscaled_scores)
    return None


def by_hand_facts(call: Node, path: str) -> dict:
    """The plan's facts of the attention call (``call``, the leaf) in the module at ``path``:
    how it is called and, written out by hand, the mask buffer its windows are read off."""
    mask = call.meta.get("window_mask")
    if mask and path and not mask.startswith(f"{path}."):
        refuse(
            "vllm_attention", f"the attention's mask is the buffer {mask}, not one of the attention module's"
        )
    return {
        "window_mask": mask and relative(mask, path),
        "attention_call": (
            AttentionCall.INTERFACE
            if call.target is not causal_sdpa
            else AttentionCall.CAUSAL_SDPA_UNSCALED
            if call.meta.get("unscaled")
            else AttentionCall.CAUSAL_SDPA
        ),
    }


def _reproduces(
    q: Node | None, k: Node, v: Node, got, scale: float | None = None, window: int | None = None
) -> bool:
    """torch's causal SDPA of ``q``, ``k``, ``v`` at ``scale`` (default: the default one),
    over the last ``window`` keys when given, gives ``got``."""
    if q is None or not torch.is_tensor(got):
        return False
    attended, _ = causal_sdpa(None, value(q), value(k), value(v), None, scaling=scale, sliding_window=window)
    want = attended.transpose(1, 2)
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def _score_scale(soft: Node) -> float | None:
    """The one constant number the scores are multiplied (or divided) by between ``q @ k^T``
    and the softmax, else None."""
    numbers = []
    for node in _score_steps(soft)[0]:  # (the fold's candidates walked it before)
        consts = [a for a in node.args if isinstance(a, int | float) and not isinstance(a, bool)]
        if _is(node, (operator.mul, torch.mul)) and len(consts) == 1:
            numbers.append(float(consts[0]))
        elif _is(node, (operator.truediv, torch.div)) and len(consts) == 1 and node.args[1] == consts[0]:
            numbers.append(1.0 / float(consts[0]))
    return numbers[0] if len(numbers) == 1 else None


def _unscaled(q: Node) -> Node | None:
    """``x`` of ``q = x / c`` or ``x * c`` with ``c`` a constant number, else None."""
    if not _is(q, (operator.truediv, operator.mul, torch.div, torch.mul, "div", "mul")) or len(q.args) != 2:
        return None
    x, c = q.args
    return x if isinstance(x, Node) and isinstance(c, int | float) else None


def _unflattened(graph, found: tuple) -> tuple:
    """``found`` of scores computed as ``[b * heads, s, d] @ [b * kv_heads, d, s]`` and viewed
    as ``[b, heads, s, s]`` (Falcon-RW, BLOOM): q, k, v and the output viewed back as
    ``[b, heads, s, d]``; the flat output node is kept in the output's ``flat_from``. Only
    the flat ones: v and the output may be per head already (GPT-NeoX-Japanese)."""
    q, k, v, out, qk, scores = found
    batch = value(scores).shape[0]
    views = []
    for node in (q, k, v, out):
        flat = value(node)
        if flat.dim() == 4:
            views.append(node)
            continue
        shape = (batch, flat.shape[0] // batch, *flat.shape[1:])
        # q, k and v viewed before the output, the output after itself: the leaf, inserted
        # after the output's view (or the output), reads them all
        with graph.inserting_after(out) if node is out else graph.inserting_before(out):
            view = graph.call_method("reshape", (node, *shape))
        _copy_meta(view, node, flat.reshape(shape))
        views.append(view)
    if views[3] is not out:
        views[3].meta["flat_from"] = out
    return (*views, qk, scores)


def _copy_meta(node: Node, like: Node, val) -> None:
    node.meta.update(
        value=val, frames=like.meta.get("frames", ()), nn_module_stack=like.meta.get("nn_module_stack", {})
    )


def _is(node: object, targets: tuple) -> bool:
    return isinstance(node, Node) and node.op in ("call_function", "call_method") and node.target in targets


def _score_steps(soft: Node) -> tuple[list[Node], Node, Node | None] | None:
    """Back from the softmax over the scale, the mask and casts to ``q @ k^T``: (the steps,
    the product, the view of flat ``[b * heads, s, s]`` scores as ``[b, heads, s, s]`` or
    None), or None when a step is not one of those."""
    scores = value(soft)
    node, qk_view, shape, steps = soft.args[0], None, scores.shape, []
    for _ in range(8):
        if _is_product(node) or (qk_view is not None and _is(node, _BADDBMM)):
            return steps, node, qk_view
        if qk_view is None and _is(node, _RESHAPES) and _flattens_heads(node.args[0], scores):
            # flat scores viewed per head, maybe scaled before the view (TeleChat)
            qk_view, node = node, node.args[0]
            shape = value(node).shape
            continue
        if _is(node, _RESHAPES) and _same_shape(node, node.args[0]):  # a view to its own shape
            node = node.args[0]
            continue
        if not _is(node, _SCORE_STEPS):
            return None
        shaped = [a for a in node.all_input_nodes if torch.is_tensor(value(a)) and value(a).shape == shape]
        if len(shaped) > 1:  # a mask of the scores' shape, given to the layer (Falcon-RW's, per head)
            shaped = [a for a in shaped if a.op != "placeholder"]
        if len(shaped) != 1:
            return None
        steps.append(node)
        node = shaped[0]
    return None


def _operands(soft: Node, traced: Traced | None = None, make_k: bool = False) -> tuple[Node, ...] | None:
    """(q, k, v, output, the value of q @ k^T as ``[b, heads, s, s]``, scores) around a
    softmax over the last dim, or None; ``make_k``: where the source computed k^T itself
    (GPT-1 splits its heads as ``[b, heads, d, s]``), a node transposing it back is added."""
    scores = value(soft)
    dim = soft.kwargs.get("dim", soft.args[1] if len(soft.args) > 1 else None)
    if not (torch.is_tensor(scores) and scores.dim() == 4 and dim in (-1, 3)):
        return None
    probs, flat = _past_casts(soft, traced), False
    users = _live_users(probs)
    if len(users) == 1 and _flattens_heads(users[0], scores):
        # probabilities viewed as [b * heads, s, s] for a 3-d @ v (and dropped out: XGLM)
        probs, flat = _past_casts(users[0], traced), True
        users = _live_users(probs)
    if len(users) != 1 or not _is_product(users[0]) or _batches(users[0])[0] is not probs:
        return None
    out, v = users[0], _batches(users[0])[1]
    walked = _score_steps(soft)
    if walked is None:
        return None
    _, node, qk_view = walked
    q, kt = _batches(node)
    k = _untransposed(kt)
    if k is None and isinstance(kt, Node) and torch.is_tensor(value(kt)) and value(kt).dim() == 4:
        k = _transposed_back(kt) if make_k else kt  # (a check only: any 4-d operand will do)
    operands = (q, k, v, out)
    # scores from flat q and k (viewed per head after the product), probabilities @ v flat
    # or per head: GPT-NeoX-Japanese's flat baddbmm scores meet a per-head @ v
    ranks = (3 if qk_view is not None else 4,) * 2 + (3 if flat else 4,) * 2
    if flat and qk_view is None:
        return None
    if not all(
        isinstance(x, Node) and torch.is_tensor(value(x)) and value(x).dim() == rank
        for x, rank in zip(operands, ranks, strict=True)
    ):
        return None
    batch = scores.shape[0]
    if any(value(x).shape[0] % batch for x in operands if value(x).dim() == 3):
        return None
    raw = value(q) @ value(kt)  # q @ k^T, before any scale or bias
    return q, k, v, out, raw.reshape(scores.shape), soft.args[0]


def _past_casts(node: Node, traced: Traced | None) -> Node:
    """Past the casts, the views to the same shape (Falcon-RW's) and the dropouts that
    returned their input (inference mode) that are ``node``'s one live user, one after the
    other."""
    while len(users := _live_users(node)) == 1 and (
        _is(users[0], _CASTS)
        or (traced is not None and is_identity_dropout(users[0], traced))
        or (_is(users[0], _RESHAPES) and _same_shape(users[0], node))
    ):
        node = users[0]
    return node


def _same_shape(a: Node, b: Node) -> bool:
    va, vb = value(a), value(b)
    return torch.is_tensor(va) and torch.is_tensor(vb) and va.shape == vb.shape


def _live_users(node: Node) -> list[Node]:
    """Users that are read: not the output (the weights returned beside), and not a value
    nothing reads (XGLM's per-head view of the weights it returns, left unread)."""
    return [u for u in node.users if u.op != "output" and u.users]


def per_head_softmax(graph) -> None:
    """A softmax over flat ``[b * heads, s, s]`` scores viewed flat from ``[b, heads, s, s]``
    (XGLM) as the softmax of the per-head scores, viewed flat after it (the same numbers: it
    runs over the last dim); a flat -> per-head -> flat view chain after it reads the flat
    probabilities themselves."""
    for soft in [n for n in graph.nodes if _is(n, _SOFTMAX)]:
        flat_scores, probs = soft.args[0], value(soft)
        dim = soft.kwargs.get("dim", soft.args[1] if len(soft.args) > 1 else None)
        if not (
            torch.is_tensor(probs) and probs.dim() == 3 and dim in (-1, 2) and _is(flat_scores, _RESHAPES)
        ):
            continue
        per_head = flat_scores.args[0]
        if not (isinstance(per_head, Node) and _flattens_heads(flat_scores, value(per_head))):
            continue
        with graph.inserting_after(soft):
            soft4 = graph.call_function(torch.softmax, (per_head,), {"dim": -1})
        with graph.inserting_after(soft4):
            flat = graph.call_method("reshape", (soft4, *probs.shape))
        _copy_meta(soft4, soft, torch.softmax(value(per_head), dim=-1))
        _copy_meta(flat, soft, probs)
        soft.replace_all_uses_with(flat)
        graph.erase_node(soft)
        for view in [u for u in flat.users if _is(u, _RESHAPES)]:
            for back in [u for u in view.users if _is(u, _RESHAPES) and value(u).shape == probs.shape]:
                back.replace_all_uses_with(flat)
                graph.erase_node(back)
            if not view.users:
                graph.erase_node(view)


def _batches(node: Node) -> tuple[object, object]:
    """(q, k^T) of ``q @ k^T`` (an einsum's included), or of ``bias.baddbmm(q, k^T, ...)``."""
    if (einsum := _einsum_operands(node)) is not None:
        return einsum
    if not _is(node, _BADDBMM):
        return node.args[0], node.args[1]
    args = node.args[1:]  # the bias comes first, as the method's object or the first argument
    return (
        node.kwargs.get("batch1", args[0] if args else None),
        node.kwargs.get("batch2", args[1] if len(args) > 1 else None),
    )


def _flattens_heads(node: object, scores: torch.Tensor) -> bool:
    """``node``'s value is ``scores``' shape with batch and heads flattened into one dim."""
    val = value(node) if isinstance(node, Node) else None
    return (
        torch.is_tensor(val)
        and val.dim() == 3
        and tuple(val.shape) == (scores.shape[0] * scores.shape[1], *scores.shape[2:])
    )


def _transposed_back(kt: Node) -> Node:
    """A node ``kt.transpose(-2, -1)`` right after ``kt``: k as ``[b, heads, s, d]``."""
    with kt.graph.inserting_after(kt):
        k = kt.graph.call_method("transpose", (kt, -2, -1))
    _copy_meta(k, kt, value(kt).transpose(-2, -1))
    k.meta["made_k"] = True  # (erased again when no fold reads it)
    return k


def _untransposed(kt: object) -> Node | None:
    """``k`` of ``k.transpose(-2, -1)`` (any spelling of the last two dims), else None."""
    if not _is(kt, ("transpose", torch.transpose)) or len(kt.args) != 3:
        return None
    rank = value(kt).dim() if torch.is_tensor(value(kt)) else 4
    dims = {d % rank for d in kt.args[1:] if isinstance(d, int)}
    return kt.args[0] if dims == {rank - 2, rank - 1} else None
