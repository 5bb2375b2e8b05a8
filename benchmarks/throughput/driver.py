"""The whole run: convert timing, the plan of models, the workers, then every model in
every mode (eager first: the budget cuts compile last)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.throughput.budget import Budget
from benchmarks.throughput.channel import Worker, start_workers
from benchmarks.throughput.convert import bench_convert
from benchmarks.throughput.machine import load_average, machine_info
from benchmarks.throughput.measure import bench_mode
from benchmarks.throughput.progress import say
from benchmarks.throughput.worker import vllm_env
from benchmarks.throughput.workloads import (
    FULL,
    MODELS,
    QUICK,
    REPO,
    VARIANTS,
    Workload,
    golden_types,
    prepare_model,
)


def run(args: argparse.Namespace) -> dict[str, Any]:
    workload = QUICK if args.quick else FULL
    if args.reps:
        workload = Workload(**{**asdict(workload), "reps": args.reps})
    budget = Budget(args.budget)
    t_start = time.perf_counter()
    results: dict[str, Any] = {
        "meta": {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "quick": args.quick,
            "workload": asdict(workload),
            "modes": args.modes,
            "budget_s": args.budget,
            "threads": args.threads,
            "machine": machine_info(),
            "load_before": load_average(),
            "argv": sys.argv[1:],
        },
        "models": {},
    }
    say(f"load average before: {results['meta']['load_before']}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.pop("TORCHDYNAMO_DISABLE", None)  # compile mode needs Dynamo
    env.update(PYTHONUNBUFFERED="1")
    tmp = Path(tempfile.mkdtemp(prefix="hfrewrite-bench-"))
    env.update(vllm_env(tmp / "vllm-cache"))
    if args.threads:  # torch's intra-op threads in every worker (the in-process
        env["OMP_NUM_THREADS"] = str(args.threads)  # engine binds no OpenMP threads)
    logs = tmp / "logs"
    logs.mkdir()
    workers: dict[str, Worker] = {}
    try:
        golden_dir = REPO / "golden"
        wanted = [s for s in MODELS if s.key in args.models]
        overrides = dict(item.split("=", 1) for item in args.generated)
        # 4. convert wall time per supported type; it also writes the files benchmarked
        conv_types = golden_types(golden_dir)
        if args.quick:
            conv_types = [t for t in conv_types if t in args.models]
        if conv_types and not args.no_convert:
            results["convert"] = bench_convert(conv_types, tmp, 1 if args.quick else args.convert_reps, env)
        plan = []
        for s in wanted:
            golden = golden_dir / s.golden
            conv = (results.get("convert") or {}).get("types", {}).get(s.model_type, {})
            if s.key in overrides:
                module = Path(overrides[s.key]).resolve()
                source = f"`{overrides[s.key]}`, given with --generated"
            elif not golden.exists():
                results["models"][s.key] = {
                    "skipped": f"golden/{s.golden} does not exist yet: hfrewrite does "
                    f"not generate {s.model_type} in this tree"
                }
                say(f"{s.key}: skipped (no golden/{s.golden})")
                continue
            elif conv.get("ok") and conv.get("output"):
                module = Path(conv["output"])
                source = f"`hfrewrite convert {s.model_type}` in this run"
                if conv.get("same_as_golden"):
                    source += f", byte-identical to golden/{s.golden}"
            else:
                module, source = golden, f"golden/{s.golden}"
            plan.append((s, module, source))
        if plan:
            workers = start_workers(env, logs, VARIANTS)
        prepared = []
        for s, module, source in plan:
            res = prepare_model(s, module, workload, tmp, workers, args.quick)
            res["generated_source"] = source
            results["models"][s.key] = res
            if "error" not in res:
                prepared.append((s.key, res))
        if prepared and not args.quick:
            key, res = prepared[0]
            arch = res["architecture"]
            r = workers["native"].call("inspect_cold", 300, architecture=arch)
            res["inspection"] = r
            if "error" not in r:
                say(f"{key}: one-time model inspection {r['cold_s']:.1f} s cold")
        # Eager for every model first, then compile: what the budget may cut last.
        phases = [(mode, key, res) for mode in args.modes for key, res in prepared]
        for i, (mode, key, res) in enumerate(phases):
            later = phases[i + 1 :]
            reserve = sum(
                2 * budget.compile_estimate(r["config"]["num_hidden_layers"]) + 60 if m == "compile" else 150
                for m, _, r in later
            )
            bench_mode(key, res, mode, workload, tmp, workers, budget, reserve)
        for _, res in prepared:
            res.pop("_load_args", None)
            res.pop("_prompts", None)
    finally:
        for w in workers.values():
            w.close()
        if args.keep_tmp:
            say(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    results["meta"]["skipped_for_time"] = budget.skipped
    results["meta"]["load_after"] = load_average()
    results["meta"]["wall_s"] = time.perf_counter() - t_start
    say(f"load average after: {results['meta']['load_after']}")
    return results
