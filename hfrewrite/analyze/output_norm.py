"""Prove a norm of the whole attention output before its projection (BitNet's sub-norm).

Pattern::

    out = attention(q, k, v)                   # [b, s, heads, head_dim]
    out = out.reshape(b, s, -1)                # [b, s, heads * head_dim]
    return o_proj(self.attn_sub_norm(out))

The file keeps the source's norm module and calls it on vLLM's ``[tokens, heads * head_dim]``
attention output. Proven on the traced values: the one norm on the path reads the attention
output laid out as ``[heads * head_dim]`` per token; the projection reads the norm's output
unchanged; and the module normalises each token alone (called on the rows flattened to
``[tokens, features]``, and on one token, it gives the same rows). It spans every head, so
under tensor parallelism the file gathers the ranks' heads before it and the projection takes
the whole input (``RowParallelLinear(input_is_parallel=False)``).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from hfrewrite.analyze.head_layout import prove_output_layout
from hfrewrite.analyze.leaf_modules import is_norm
from hfrewrite.analyze.plan import refuse
from hfrewrite.analyze.trace import Traced, relative, value

_PASS = "vllm_attention"


def output_norm(traced: Traced, path: str, call: Node, o_node: Node, on_path: list[Node]) -> str | None:
    """The attention's attribute of the norm between its output and the output projection,
    proven as the module docstring says; None where the path holds no norm."""
    norms = [n for n in on_path if n.op == "call_module" and is_norm(traced.submodule(n))]
    if not norms:
        return None
    if len(norms) > 1:
        refuse(_PASS, f"the attention output passes {len(norms)} norms before its projection")
    norm = norms[0]
    if not norm.args or not isinstance(norm.args[0], Node):
        refuse(_PASS, "the norm of the attention output takes no tensor")
    prove_output_layout(call, norm)  # it reads [heads * head_dim] per token
    normed, read = value(norm), value(o_node.args[0]) if o_node.args else None
    if not (torch.is_tensor(normed) and torch.is_tensor(read) and torch.equal(normed, read)):
        refuse(_PASS, "the output projection does not read the norm of the attention output as it is")
    if not normalises_each_token(traced.submodule(norm), value(norm.args[0]), normed):
        refuse(_PASS, "the norm of the attention output does not normalise each token alone")
    return relative(norm.target, path)


def normalises_each_token(module: torch.nn.Module, given: torch.Tensor, normed: torch.Tensor) -> bool:
    """``module`` gives ``normed``'s rows on ``given`` flattened to ``[tokens, features]``
    (vLLM's layout), and the first token's row on that token alone."""
    rows = given.reshape(-1, given.shape[-1])
    want = normed.reshape(-1, normed.shape[-1])
    try:
        with torch.no_grad():
            flat, first = module(rows), module(rows[:1])
    except (RuntimeError, ValueError, IndexError):
        return False
    return (
        torch.is_tensor(flat)
        and flat.shape == want.shape
        and torch.allclose(flat, want, atol=1e-6)
        and torch.allclose(first, want[:1], atol=1e-6)
    )
