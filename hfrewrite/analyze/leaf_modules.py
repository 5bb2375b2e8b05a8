"""Which modules the tracer records as one call (leaves) instead of tracing through:
Linears and Embeddings (a subclass's own forward: unproven, opaque), norms, containers of
norms, stacked MoE experts and activation modules. What each computes is proven on values
where it is used."""

from __future__ import annotations

from torch import nn

_ACTIVATION_MODULES = ("torch.nn.modules.activation", "transformers.activations")


def is_norm(module: nn.Module) -> bool:
    """A norm leaf: a childless module whose class name ends in ``Norm``."""
    return type(module).__name__.endswith("Norm") and not any(module.children())


def is_norm_list(module: nn.Module) -> bool:
    """Norms kept in a container of the source's own class (StableLM-2's per-head LayerNorms,
    ``norms[h]`` for head ``h``): every module below it a norm leaf, no tensor of its own.
    Traced as one leaf; what it computes is proven on values where it is used."""
    below = list(module.modules())[1:]
    return (
        bool(below)
        and not isinstance(module, nn.ModuleList)
        and all(is_norm(m) or (isinstance(m, nn.ModuleList) and any(m.children())) for m in below)
        and not any(True for _ in module.parameters(recurse=False))
        and not any(True for _ in module.buffers(recurse=False))
    )


def is_head_norm(module: nn.Module) -> bool:
    """What may normalise q or k: a norm leaf, or a container of them (``is_norm_list``)."""
    return is_norm(module) or is_norm_list(module)


def is_experts(module: nn.Module) -> bool:
    """Stacked MoE experts (transformers 5.x ``@use_experts_implementation``): a module
    holding 3-D ``[num_experts, out, in]`` parameters, traced as one leaf."""
    return any(p.dim() == 3 for p in module.parameters(recurse=False))


def is_leaf(module: nn.Module) -> bool:
    return (
        isinstance(module, (nn.Linear, nn.Embedding))  # a subclass's own forward: unproven, opaque
        or is_norm(module)
        or is_norm_list(module)
        or is_experts(module)
        or type(module).__module__ in _ACTIVATION_MODULES
    )
