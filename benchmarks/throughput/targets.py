"""The targets: the generated file against vLLM native, judged within the noise."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

from benchmarks.throughput.stats import paired_ratios, summarize

THROUGHPUT_TOLERANCE = 0.02  # a paired median >= 0.98 is 1.00 outright


def throughput_verdict(paired_median: float, noise: float) -> bool | str:
    """True: paired median >= 1 - tolerance; "within noise": lower, but by less than
    the measured noise (the larger relative spread of the two variants); False:
    slower than native by more than the noise."""
    if paired_median >= 1.0 - THROUGHPUT_TOLERANCE:
        return True
    return "yes, within noise" if paired_median >= 1.0 - noise else False


def gen_native_verdict(var: dict[str, dict]) -> bool | str | None:
    """``throughput_verdict`` of the generated file against native, from samples."""
    gen, nat = var.get("generated", {}), var.get("native", {})
    pr = paired_ratios(gen.get("tps") or [], nat.get("tps") or [])
    if not pr:
        return None
    noise = max(summarize(gen["tps"])["spread"] or 0, summarize(nat["tps"])["spread"] or 0)
    return throughput_verdict(statistics.median(pr), noise)


def measured_modes(results: dict) -> Iterator[tuple[str, str, dict]]:
    """(model key, mode, mode results) for every mode that ran."""
    for key, m in results.get("models", {}).items():
        for mode, mres in (m.get("modes") or {}).items():
            if "variants" in mres:
                yield key, mode, mres


def targets(results: dict) -> list[dict[str, Any]]:
    """The issue's targets, judged per model and mode (within the measured noise)."""
    rows = []
    for key, mode, mres in measured_modes(results):
        var = mres["variants"]
        gen, nat = var.get("generated", {}), var.get("native", {})
        ratio = mres.get("ratios", {}).get("generated", {})
        pr = ratio.get("throughput_paired") or {}
        noise = max(
            (gen.get("throughput") or {}).get("spread") or 0,
            (nat.get("throughput") or {}).get("spread") or 0,
        )
        thr = None
        if pr.get("median") is not None:
            thr = throughput_verdict(pr["median"], noise)
        su = ratio.get("startup_of_medians")
        su_noise = summarize(nat.get("startup_s") or []).get("spread") or 0
        su_n = min(len(gen.get("startup_s") or []), len(nat.get("startup_s") or []))
        su_ok = None
        if su is not None and su_n >= 2:
            su_ok = True if su <= 1.05 else "yes, within noise" if su <= 1.05 + su_noise else False
        gp = ratio.get("gemm_per_layer")
        per = "layer"
        if not gp or gp[0] is None:
            gp, per = ratio.get("gemm_per_forward"), "forward"
        rows.append(
            {
                "model": key,
                "mode": mode,
                "throughput_ratio": pr.get("median"),
                "throughput_ratio_range": (pr.get("min"), pr.get("max")),
                "cpu_ratio": (ratio.get("cpu_paired") or {}).get("median"),
                "best_ratio": ratio.get("throughput_best"),
                "noise": noise,
                "throughput_ok": thr,
                "startup_ratio": su,
                "startup_noise": su_noise,
                "startup_ok": su_ok,
                "startup_n": su_n,
                "gemm": gp,
                "gemm_per": per,
                "gemm_ok": None if not gp else gp[0] <= gp[1],
                "generated_runs": "error" not in gen,
                "native_runs": "error" not in nat,
            }
        )
    return rows
