"""Proofs that only layout lies between the projections and the attention call (and between
the attention and the output projection): views, transposes, splits the rewrite re-derives."""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from hfrewrite.analyze.leaf_modules import is_head_norm
from hfrewrite.analyze.plan import refuse
from hfrewrite.analyze.trace import Traced, relative, scopes, value

# What may lie between a projection and the attention (and between the attention and the
# output projection) besides the proven rope and q/k norms: the rewrite re-derives the
# layout and drops these, so anything else (a scale, an activation) must refuse.
_LAYOUT_METHODS = {
    "view",
    "reshape",
    "transpose",
    "contiguous",
    "permute",
    "flatten",
    "unflatten",
    "unsqueeze",
    "squeeze",
    "to",
    "float",
    "type_as",
    "chunk",
    "split",
    "expand",
    "broadcast_to",
    "repeat_interleave",
    "repeat",  # kv heads repeated: the head counts must still agree
    "clamp",
    "clamp_",
    "clip",
    "clip_",  # a config's clip_qkv: the rewrite carries its `if`
}
_LAYOUT_FUNCTIONS = (
    operator.getitem,
    torch.transpose,
    torch.reshape,
    torch.chunk,
    torch.split,
    torch.flatten,
    torch.clamp,
    torch.broadcast_to,  # kv heads broadcast to every query head (Falcon-40B), as "expand"
)


def prove_head_layout(
    traced: Traced,
    path: str,
    proj: Node,
    head_shaped: Node,
    heads: int,
    head_dim: int,
    norm: str | None,
    norm_over: str | None,
    role: str,
    packed: bool = False,
    scale: float = 1.0,
) -> None:
    """The layout ops between a projection and its head-shaped value (the rope's input,
    or the attention's) are the split vLLM assumes: ``[b, s, heads * d]`` ->
    ``[b, heads, s, d]`` (or ``[b, s, heads, d]``, a rope's input), head after head (through the q/k norm, if any), checked on
    the traced values: a transpose against head_dim has the same shape, not the values.
    ``packed``: the projection holds ``[heads, 2 * d]``, the head the first half of each;
    ``scale``: a number the path multiplies by (path_scale.py), divided out."""
    out, got = value(proj), value(head_shaped)
    got = got / scale if torch.is_tensor(got) and scale != 1.0 else got
    if not (torch.is_tensor(out) and torch.is_tensor(got) and out.dim() == 3):
        refuse(
            "vllm_attention",
            f"the {role} projection's output is not [batch, seq, features]",
        )
    if packed:
        out = out.reshape(*out.shape[:2], heads, 2 * head_dim)[..., :head_dim].reshape(*out.shape[:2], -1)
    layouts = []
    # the projection read [b, s, features], or [s, b, features] (TeleChat transposes first)
    for rows in (out, out.transpose(0, 1)):
        b, s, _ = rows.shape
        want = _normed_as_vllm(traced, path, norm, norm_over, rows.reshape(b * s, -1), heads, head_dim)
        if want is None:
            break
        want = want.reshape(b, s, heads, head_dim)
        # [b, heads, s, d], or [b, s, heads, d] where the rope runs before the transpose
        # (ERNIE-4.5), or batch and heads merged: [b * heads, s, d], [s, b * heads, d] (TeleChat)
        merged = want.transpose(1, 2).reshape(b * heads, s, head_dim)
        layouts += [want.transpose(1, 2), want, merged, merged.transpose(0, 1)]
    if not any(got.shape == w.shape and torch.allclose(got.double(), w.double(), atol=1e-6) for w in layouts):
        refuse(
            "vllm_attention",
            f"the {role} path does not split the projection into heads as "
            "[heads, head_dim] (checked on the traced values)",
        )


def _normed_as_vllm(
    traced: Traced,
    path: str,
    norm: str | None,
    over: str | None,
    tokens: torch.Tensor,
    heads: int,
    head_dim: int,
) -> torch.Tensor | None:
    """The projection's rows ``[tokens, features]`` as the file lays them out,
    ``[tokens, heads, head_dim]``, through the q/k norm called as the file calls it (over
    all heads on ``[tokens, features]``, per head on ``[tokens, heads, head_dim]``); None
    where the norm cannot take that layout (it then does not compute what the file would)."""
    module = traced.module.get_submodule(f"{path}.{norm}" if path else norm) if norm else None
    try:
        with torch.no_grad():
            if module is not None and over == "all_heads":
                tokens = module(tokens)
            by_head = tokens.reshape(tokens.shape[0], heads, head_dim)
            if module is not None and over in ("head", "each_head"):
                by_head = module(by_head)
    except (RuntimeError, ValueError, IndexError):
        return None
    return (
        by_head if torch.is_tensor(by_head) and by_head.shape == (tokens.shape[0], heads, head_dim) else None
    )


def prove_output_layout(call: Node, o_node: Node) -> None:
    """The output projection reads the attention output ``[b, s, heads, d]`` as
    ``[b, s, heads * d]`` (or ``[s, b, heads * d]``): per token, the layout vLLM's
    ``Attention`` returns (checked on values)."""
    out = value(call)
    out = out[0] if isinstance(out, (tuple, list)) else out
    got = value(o_node.args[0]) if o_node.args else None
    if not (torch.is_tensor(out) and torch.is_tensor(got) and out.dim() == 4):
        refuse(
            "vllm_attention",
            "the attention output is not [batch, seq, heads, head_dim]",
        )
    want = out.reshape(*out.shape[:2], -1)
    if got.shape == want.transpose(0, 1).shape and got.shape != want.shape:
        want = want.transpose(0, 1)  # sequence first (ChatGLM): [s, b, heads * d], the same rows
    if got.shape != want.shape or not torch.equal(got, want):
        refuse(
            "vllm_attention",
            "the output projection does not read the attention output as "
            "[heads * head_dim] per token (checked on the traced values)",
        )


def only_layout(nodes: list[Node], traced: Traced, what: str, path: str) -> None:
    """Each node moves lanes or heads only; else a refusal naming the op and, below the
    attention module ``path``, the submodule it ran in."""
    for n in nodes:
        if _shape_arithmetic(n):
            continue  # `x.size()[:-1] + (heads, head_dim)`: sizes for a view, no tensor data
        ok = (
            (n.op == "call_method" and n.target in _LAYOUT_METHODS)
            or (n.op == "call_function" and n.target in _LAYOUT_FUNCTIONS)
            or (n.op == "call_module" and is_head_norm(traced.submodule(n)))
            or n.op == "get_attr"
        )
        if not ok:
            name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
            refuse(
                "vllm_attention",
                f"{what} computes {name}{_ran_in(n, traced, path)}, which the rewrite would not keep",
            )


def _ran_in(node: Node, traced: Traced, path: str) -> str:
    """`` in <module> (<class>)``: the innermost module below ``path`` a node ran in, or ""."""
    ran_in = scopes(node)
    if not ran_in or ran_in[-1] == path:
        return ""
    try:
        inner = type(traced.module.get_submodule(ran_in[-1])).__name__
    except AttributeError:
        return ""
    return f" in {relative(ran_in[-1], path)} ({inner})"


def norm_through_layout(node: Node, traced: Traced) -> Node | None:
    """The norm call ``node`` is, or reads through layout that moves no lane (Llama-4
    normalises q after its rope, then swaps heads and tokens for the attention); else None."""
    norm = node
    while (norm.op == "call_method" and norm.target in _LAYOUT_METHODS) or (
        norm.op == "call_function" and norm.target in (torch.transpose, torch.reshape, torch.flatten)
    ):
        if not norm.args or not isinstance(norm.args[0], Node):
            return None
        norm = norm.args[0]
    if not (norm.op == "call_module" and is_head_norm(traced.submodule(norm))):
        return None
    normed, given = value(norm), value(node)
    if norm is node or (
        torch.is_tensor(normed)
        and torch.is_tensor(given)
        and normed.dim() == 4
        and any(v.shape == given.shape and torch.equal(v, given) for v in (normed, normed.transpose(1, 2)))
    ):
        return norm
    return None


def _shape_arithmetic(node: Node) -> bool:
    """A node computing sizes: its value a ``torch.Size``, int or tuple of ints, never a
    tensor; whatever it feeds into the tensor path is itself a checked node."""
    v = node.meta.get("value")
    if isinstance(v, tuple):
        return all(isinstance(x, int) for x in v)
    return isinstance(v, int) and not isinstance(v, bool)
