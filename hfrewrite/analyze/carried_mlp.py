"""A feed-forward block no rewrite fits, kept as the source writes it.

The design rule: where a replacement's proof fails, the site keeps the source's code. A
dense MLP that no form of :mod:`hfrewrite.analyze.mlp_forms` fits (an inner norm, an
activation over more than one lane), or a mixture of experts vLLM's fused MoE is not proven
to compute (a routing of its own), still runs inside vLLM as PyTorch, its weights whole on
every tensor-parallel rank, provided it computes each token from that token alone: vLLM
hands a layer the tokens of all sequences as one ``[tokens, hidden]`` batch.

Proof, on the traced layer's values: the block called with its one tensor argument as
traced (``[batch, seq, hidden]``), flattened to vLLM's ``[tokens, hidden]``, and one token at
a time gives the same values; and torch.compile captures it as one graph over any number of
tokens, as vLLM compiles the model. A block that mixes tokens, needs the batch layout, takes
more than the hidden states or branches on its values (a Python loop over the experts the
tokens chose) keeps the refusal its rewrite gave, with this reason added.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from hfrewrite.analyze.example_run import error_line
from hfrewrite.analyze.leaf_modules import is_experts
from hfrewrite.analyze.mlp import analyze_mlp, torch_container
from hfrewrite.analyze.mlp_forms import KeptMlp, MlpForm
from hfrewrite.analyze.plan import MlpPlan, NoMatch, Refusal
from hfrewrite.analyze.trace import Traced, relative

PATTERN = "carried_mlp"
_TOLERANCE = 1e-5  # float32 on the same weights: only the summation order differs


def carry_mlp(traced: Traced, path: str, declined: NoMatch, config=None) -> tuple[NoMatch, KeptMlp]:
    """The declined fact of keeping the block ``path`` from the source, where it is proven
    per token and one graph, and the Linears it calls (attributes of its class); otherwise a
    refusal: ``declined`` and why the block cannot be kept."""
    why = _why_not_kept(traced, path)
    if why is not None:
        reason = f"{declined.reason}; the source's block cannot be kept: {why}"
        raise Refusal(NoMatch(declined.pattern, declined.module_class, reason))
    container = torch_container(traced.module.get_submodule(path))  # no class of the source
    pair = container and _sequential_pair(traced, path, config)
    linears = (
        "its first and last Linears vLLM's column- and row-parallel pair"
        if pair
        else "its Linears replicated"
    )
    kept = NoMatch(
        PATTERN,
        declined.module_class,
        f"{declined.pattern}: {declined.reason}; the source's block is kept (each token computed "
        f"alone, one graph for torch.compile: proven on the traced values), {linears}",
    )
    attrs = [] if container else [relative(n.target, path) for n in traced.linears_in(path)]
    linear_attrs = tuple(sorted({a for a in attrs if "." not in a}))
    return kept, KeptMlp(declined.module_class, linear_attrs, parallel_at=path if pair else "")


def _sequential_pair(traced: Traced, path: str, config) -> bool:
    """The layer's own child ``path`` is an ``nn.Sequential`` whose first child is the up
    projection and last the down projection of an ungated MLP (the act between them proven
    per lane), the children between them holding no tensors (the file builds them on the
    meta device): vLLM's column- and row-parallel pair computes it, each rank on its columns."""
    block = traced.module.get_submodule(path)
    if "." in path or not isinstance(block, nn.Sequential) or len(block) < 2:
        return False
    plan = analyze_mlp(traced, path, config, container=True)
    names = list(block._modules)
    return (
        isinstance(plan, MlpPlan)
        and plan.form is MlpForm.UNGATED
        and (plan.up.attr, plan.down.attr) == (names[0], names[-1])
        and not any([*block[i].parameters(), *block[i].buffers()] for i in range(1, len(block) - 1))
    )


def _why_not_kept(traced: Traced, path: str) -> str | None:
    """Why the block at ``path`` cannot run as written in vLLM's compiled forward over its
    flat token batch, or None."""
    args, kwargs = traced.called_with.get(path, ((), {}))
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if len(tensors) != 1 or tensors[0].dim() != 3:
        return "it is not called with the hidden states alone"
    block: nn.Module = traced.module.get_submodule(path)
    if any(is_experts(m) and _dispatched(m) for m in block.modules()):
        # @use_experts_implementation: the config picks the code at run time, not this trace
        return "its stacked experts run the implementation the config names at run time"
    (x,) = tensors
    flat = x.reshape(-1, x.shape[-1])

    def call(h: torch.Tensor):  # the traced call, the hidden states replaced by h
        return block(
            *(h if a is x else a for a in args), **{k: h if v is x else v for k, v in kwargs.items()}
        )

    try:
        with torch.no_grad():
            whole, batch = call(x), call(flat)
            alone = [call(flat[i : i + 1]) for i in range(flat.shape[0])]
    except Exception as exc:  # noqa: BLE001 - the source's own code refusing vLLM's layout
        return f"it fails on vLLM's [tokens, hidden] layout ({type(exc).__name__})"
    if not all(isinstance(o, torch.Tensor) for o in (whole, batch, *alone)):
        return "it does not return one tensor"
    if whole.shape != x.shape or batch.shape != flat.shape:
        return "it does not return one hidden state per token"
    if (torch.cat(alone) - whole.reshape(flat.shape)).abs().max() > _TOLERANCE:
        return "a token's output depends on other tokens"
    if (torch.cat(alone) - batch).abs().max() > _TOLERANCE:
        return "it computes otherwise on vLLM's [tokens, hidden] layout"
    return _not_one_graph(call, flat)


def _dispatched(experts: nn.Module) -> bool:
    """The experts' forward is transformers' dispatch to the implementation its config names
    (``@use_experts_implementation``), not code of their own (Llama-4's ``bmm``)."""
    from transformers.integrations import moe

    return type(experts).forward.__code__.co_filename == moe.__file__


def _not_one_graph(call, flat: torch.Tensor) -> str | None:
    """Why torch.compile cannot capture the block as one graph over any number of tokens,
    or None: vLLM compiles the model so (``fullgraph=True``, the token count dynamic), and a
    branch on the values (a loop over the experts the tokens chose) breaks it."""
    torch._dynamo.reset()
    flat = flat.clone()
    torch._dynamo.mark_dynamic(flat, 0)
    try:
        with torch.no_grad(), _dynamo_enabled():
            torch.compile(call, fullgraph=True, backend="eager")(flat)
    except Exception as exc:  # noqa: BLE001 - dynamo's reason, first line
        return f"torch.compile cannot capture it as one graph, as vLLM compiles models ({error_line(exc)})"
    finally:
        torch._dynamo.reset()
    return None


@contextmanager
def _dynamo_enabled() -> Iterator[None]:
    """torch.compile compiling, whatever the environment says: with ``TORCHDYNAMO_DISABLE=1``
    or ``TORCH_COMPILE_DISABLE=1`` it returns the function as it is, and the proof above would
    pass without capturing anything."""
    saved = os.environ.pop("TORCHDYNAMO_DISABLE", None)
    try:
        with torch._dynamo.config.patch(disable=False):
            yield
    finally:
        if saved is not None:
            os.environ["TORCHDYNAMO_DISABLE"] = saved
