"""One model in one mode: start-up, throughput rounds, GEMM profile, agreement."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.throughput.budget import Budget
from benchmarks.throughput.channel import Worker
from benchmarks.throughput.orders import rotate, run_order
from benchmarks.throughput.progress import err_line, say
from benchmarks.throughput.stats import (
    agreements,
    ratios_to_native,
    summarize,
    tokens_digest,
)
from benchmarks.throughput.targets import gen_native_verdict
from benchmarks.throughput.workloads import VLLM_VARIANTS, Workload


def bench_mode(
    key: str,
    res: dict[str, Any],
    mode: str,
    workload: Workload,
    tmp: Path,
    workers: dict[str, Worker],
    budget: Budget,
    reserve_s: float = 0.0,
) -> None:
    """One model in one mode (eager: the three vLLM variants and Hugging Face;
    compile: the vLLM variants), into ``res["modes"][mode]``."""
    names = list(VLLM_VARIANTS) + (["hf"] if mode == "eager" else [])
    if mode == "compile":
        est = budget.compile_estimate(res["config"]["num_hidden_layers"])
        if not budget.allows(reserve_s + 2 * est + 60, f"{key}/compile"):
            res["modes"][mode] = {"skipped": "not enough time left in the budget"}
            return
        if not budget.allows(reserve_s + 3 * est + 80, f"{key}/compile: the Transformers backend"):
            names.remove("transformers")
    mres = res["modes"][mode] = {"variants": {n: {} for n in names}}
    for n in names:
        mres["variants"][n]["import_s"] = workers[n].import_s
    try:
        _run_mode(
            mres,
            workers,
            names,
            res["_prompts"],
            workload,
            res["_load_args"],
            tmp,
            key,
            mode,
            budget,
            res["config"]["num_hidden_layers"],
            reserve_s,
        )
    finally:
        for n in names:
            workers[n].call("unload", 120)


def _run_mode(
    mres: dict,
    workers: dict[str, Worker],
    names: list[str],
    prompts: list[list[int]],
    workload: Workload,
    load_args: dict,
    tmp: Path,
    key: str,
    mode: str,
    budget: Budget,
    layers: int,
    reserve_s: float,
) -> None:
    var = mres["variants"]
    compile_ = mode == "compile"
    load_timeout = 900 if compile_ else 300
    # Start-up: the first LLM() of each variant (a cold compile cache in compile
    # mode), then in eager mode rebuilds interleaved across variants.
    for n in rotate(names, len(key) + len(mode)):
        args = dict(load_args)
        if compile_:
            args.update(compile=True, cache_root=str(tmp / f"cache-{key}-{mode}-{n}"))
        r = workers[n].call("load", load_timeout, **args)
        if "error" in r:
            var[n]["error"] = f"load: {err_line(r)}"
            var[n]["error_detail"] = r["error"][-3000:]
            say(f"{key}/{mode}/{n}: load FAILED: {err_line(r)}")
            continue
        var[n].update(startup_first_s=r["startup_s"], startup_s=[r["startup_s"]])
        if compile_:
            per_layer = r["startup_s"] / layers
            budget.compile_s_per_layer = max(budget.compile_s_per_layer, per_layer)
        var[n]["model_class"] = r.get("model_class")
        var[n]["threads"] = (r.get("torch_threads"), r.get("affinity"))
        say(f"{key}/{mode}/{n}: start-up {r['startup_s']:.1f} s ({r['model_class']})")
    vllm_alive = [n for n in names if "error" not in var[n] and n != "hf"]
    if not compile_:
        for rep in range(1, workload.startup_reps):
            if not budget.allows(240, f"{key}/{mode}: start-up rebuild {rep + 1}"):
                break
            for n in run_order(vllm_alive, rep):
                workers[n].call("unload", 120)
                r = workers[n].call("load", load_timeout, **load_args)
                if "error" in r:
                    var[n]["error"] = f"reload: {err_line(r)}"
                    continue
                var[n]["startup_s"].append(r["startup_s"])
    alive = [n for n in names if "error" not in var[n]]
    # Throughput: warm-up, then rounds of every variant in balanced orders; at least
    # workload.reps, more (up to max_reps) while a round is short and time is left;
    # then, while generated vs native is not yet clearly >= 1, extra generated/native
    # pairs (up to max_extra_pairs) to firm up the ratio that matters.
    for n in alive:
        var[n].update(warmup_tps=[], tps=[], seconds=[], cpu_s=[], digests=[])

    def one_round(order: Sequence[str], label: str, warm: bool) -> float:
        t0 = time.perf_counter()
        for n in order:
            if "error" in var[n]:
                continue
            time.sleep(workload.pause_s)
            r = workers[n].call("generate", 900, prompts=prompts, max_tokens=workload.new_tokens)
            if "error" in r:
                var[n]["error"] = f"generate: {err_line(r)}"
                continue
            tps = r["n_out"] / r["seconds"]
            if warm:
                var[n]["warmup_tps"].append(tps)
                continue
            var[n]["tps"].append(tps)
            var[n]["seconds"].append(r["seconds"])
            var[n]["cpu_s"].append(r["cpu_s"])
            var[n]["digests"].append(tokens_digest(r["tokens"]))
            var[n].setdefault("tokens", r["tokens"])
            var[n]["n_out"] = r["n_out"]
        got = [
            f"{n} {(var[n]['warmup_tps'] if warm else var[n]['tps'])[-1]:.1f}"
            for n in order
            if (var[n]["warmup_tps"] if warm else var[n]["tps"])
        ]
        say(f"{key}/{mode} {label}: {', '.join(got)} tok/s")
        return time.perf_counter() - t0

    for rep in range(-workload.warmup, workload.reps):
        last = one_round(run_order(alive, rep), "warm-up" if rep < 0 else f"rep {rep + 1}", rep < 0)
    rep = workload.reps
    while (
        rep < workload.max_reps
        and last <= workload.extra_rep_max_s
        and budget.allows(reserve_s + 2 * last, f"{key}/{mode}: extra rounds", quiet=True)
    ):
        last = one_round(run_order(alive, rep), f"rep {rep + 1}", False)
        rep += 1
    pair = [n for n in ("generated", "native") if n in alive]
    extra = 0
    while (
        len(pair) == 2
        and all("error" not in var[n] for n in pair)
        and extra < workload.max_extra_pairs
        and gen_native_verdict(var) is not True
    ):
        pair_s = var["generated"]["seconds"][-1] + var["native"]["seconds"][-1]
        if not budget.allows(reserve_s + 2 * pair_s, f"{key}/{mode}: extra gen/native pairs"):
            break
        one_round(pair if extra % 2 else pair[::-1], f"extra pair {extra + 1}", False)
        extra += 1
    mres["extra_pairs"] = extra
    for n in alive:
        if var[n].get("tps"):
            var[n]["throughput"] = summarize(var[n]["tps"])
            var[n]["cpu_ms_per_token"] = summarize([1000 * c / var[n]["n_out"] for c in var[n]["cpu_s"]])
            var[n]["deterministic"] = len(set(var[n]["digests"])) <= 1
        var[n].pop("digests", None)
    # GEMM calls per decoder layer (one prompt: one prefill + one decode forward).
    for n in alive:
        if "error" in var[n]:
            continue
        r = workers[n].call("profile", 600, prompts=prompts[:1], max_tokens=2, hooks=not compile_)
        if "error" in r:
            var[n]["gemm_error"] = err_line(r)
            continue
        var[n]["gemm"] = r
        say(
            f"{key}/{mode}/{n}: GEMMs per layer {r['gemm_per_layer']}, per forward "
            f"{r['gemm_total'] / r['forwards']:g}; in layers {r['gemm_in_layers']}, "
            f"fused MoE {r['moe_kernels_in_layers']}"
        )
    mres["agreement"] = agreements({n: v.get("tokens") for n, v in var.items()})
    mres["ratios"] = ratios_to_native(var)
