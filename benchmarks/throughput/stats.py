"""Statistics of the samples: summaries, paired ratios, agreement of greedy tokens."""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Sequence
from typing import Any


def summarize(samples: Sequence[float]) -> dict[str, Any]:
    """Median, min, max, count and relative spread ((max - min) / median)."""
    xs = [float(x) for x in samples if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0, "spread": None}
    med = statistics.median(xs)
    return {
        "median": med,
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
        "spread": (max(xs) - min(xs)) / med if med else None,
    }


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``a[i] / b[i]`` for samples taken side by side (same repetition)."""
    return [x / y for x, y in zip(a, b) if x is not None and y]


def agreement(tokens: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> dict:
    """How far two sets of greedy continuations agree, prompt by prompt.

    ``identical``: sequences equal in full; ``token_match``: fraction of positions
    equal; ``first_divergence``: earliest step at which any sequence differs (None
    when all are identical).
    """
    n_seq = min(len(tokens), len(ref))
    identical = 0
    same = total = 0
    first = None
    for a, b in zip(tokens, ref):
        n = max(len(a), len(b))
        total += n
        same += sum(1 for x, y in zip(a, b) if x == y)
        if list(a) == list(b):
            identical += 1
            continue
        step = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        first = step if first is None else min(first, step)
    if len(tokens) != len(ref):
        first = 0 if first is None else first
    return {
        "identical": identical,
        "n": max(len(tokens), len(ref)),
        "token_match": same / total if total else 1.0,
        "first_divergence": first,
        "compared": n_seq,
    }


def agreements(tokens: dict[str, Any], refs: Sequence[str] = ("native", "hf")) -> dict:
    """``agreement`` of each variant's tokens with each reference's, every unordered
    pair once, keyed ``"variant~reference"``."""
    out: dict[str, dict] = {}
    seen: set[frozenset[str]] = set()
    for ref in refs:
        for n, toks in tokens.items():
            pair = frozenset((n, ref))
            if n == ref or pair in seen or toks is None or tokens.get(ref) is None:
                continue
            seen.add(pair)
            out[f"{n}~{ref}"] = agreement(toks, tokens[ref])
    return out


def tokens_digest(tokens: Sequence[Sequence[int]]) -> str:
    return hashlib.sha256(json.dumps([list(t) for t in tokens]).encode()).hexdigest()[:12]


def ratios_to_native(var: dict[str, dict]) -> dict[str, dict]:
    """Each variant against vLLM native: throughput per repetition (paired: adjacent
    runs), CPU time per token, start-up medians and GEMM counts."""
    nat = var.get("native", {})
    out: dict[str, dict] = {}
    for n, v in var.items():
        if n == "native" or not nat.get("tps") or not v.get("tps"):
            continue
        r: dict[str, Any] = {
            "throughput_paired": summarize(paired_ratios(v["tps"], nat["tps"])),
            "throughput_of_medians": v["throughput"]["median"] / nat["throughput"]["median"],
            # fastest run against fastest run: the least disturbed of each
            "throughput_best": max(v["tps"]) / max(nat["tps"]),
            # CPU seconds per token, native / variant: > 1 means the variant is cheaper
            "cpu_paired": summarize(paired_ratios(nat["cpu_s"], v["cpu_s"])),
        }
        if v.get("startup_s") and nat.get("startup_s"):
            r["startup_of_medians"] = statistics.median(v["startup_s"]) / statistics.median(nat["startup_s"])
        g, ng = v.get("gemm"), nat.get("gemm")
        if g and ng:
            r["gemm_per_layer"] = (g["gemm_per_layer"], ng["gemm_per_layer"])
            r["gemm_per_forward"] = (
                g["gemm_total"] / g["forwards"],
                ng["gemm_total"] / ng["forwards"],
            )
        out[n] = r
    return out
