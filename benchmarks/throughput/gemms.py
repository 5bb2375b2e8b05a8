"""GEMM calls per decoder layer, counted from ``torch.profiler`` events (pure)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

# Ops counted as one GEMM call (profiler event names). aten::linear/matmul are
# composites over mm/addmm, so only the outermost GEMM event of a nest is counted; vLLM's
# CPU linear kernels are custom ops (oneDNN ``_C::onednn_mm``, sgl
# ``_C::weight_packed_linear``, zentorch); fused-MoE expert kernels are counted apart.
GEMM_ATEN = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::matmul",
        "aten::linear",
        "aten::_addmm_activation",
    }
)
_CUSTOM_GEMM = re.compile(r"^(_C|zentorch|_C_cpu|vllm)::\w*(mm|gemm|linear)\w*$", re.IGNORECASE)
_MOE_KERNEL = re.compile(r"^\w+::\w*(moe|expert)\w*$", re.IGNORECASE)
_ATTENTION = re.compile(r"attention|attn", re.IGNORECASE)


def is_gemm(name: str) -> bool:
    """A dense GEMM call: an ATen matmul op or one of vLLM's CPU linear kernels."""
    return name in GEMM_ATEN or bool(_CUSTOM_GEMM.match(name))


def is_moe_kernel(name: str) -> bool:
    """A fused mixture-of-experts kernel call (grouped expert GEMMs in one op)."""
    return bool(_MOE_KERNEL.match(name)) and not is_gemm(name)


def count_gemms(events: Iterable[tuple[str, Sequence[str]]], layer_marker: str) -> dict[str, Any]:
    """Count GEMM calls from ``(op name, ancestor names outermost-first)`` pairs.

    A GEMM event counts when no ancestor is a GEMM (composites count once) and no
    ancestor is an attention op (matmuls inside attention are not projections).
    ``layer_marker`` is the profiler range opened around each decoder layer; returns
    the number of layer ranges, the GEMM and fused-MoE calls inside them (per op name)
    and the ones outside (embedding, lm_head, sampler).
    """
    in_layer: Counter[str] = Counter()
    outside: Counter[str] = Counter()
    moe: Counter[str] = Counter()
    layers = 0
    for name, ancestors in events:
        if name == layer_marker:
            layers += 1
            continue
        inside = layer_marker in ancestors
        if is_gemm(name):
            if any(is_gemm(a) or _ATTENTION.search(a) for a in ancestors):
                continue
            (in_layer if inside else outside)[name] += 1
        elif inside and is_moe_kernel(name) and not any(is_moe_kernel(a) for a in ancestors):
            moe[name] += 1
    n_in = sum(in_layer.values())
    return {
        "layer_calls": layers,
        "gemm_in_layers": dict(in_layer),
        "gemm_outside_layers": dict(outside),
        "moe_kernels_in_layers": dict(moe),
        "gemm_total": n_in + sum(outside.values()),
        "gemm_per_layer": n_in / layers if layers else None,
        "moe_kernels_per_layer": sum(moe.values()) / layers if layers else None,
    }
