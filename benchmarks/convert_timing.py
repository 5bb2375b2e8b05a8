"""Where `hfrewrite convert` and `hfrewrite check` spend their time (docs/benchmarks.md).

    python benchmarks/convert_timing.py [--types T ...] [--reps 3] [--validate T ...] [--check]

Per type, ``reps`` fresh processes each convert it once and report their phases: import
(torch, transformers, libcst and hfrewrite), analyze (build and trace the shrunk copy, prove
the replacements), rewrite (parse the modeling file, run the passes), format, and validate
(the convert-time run in vLLM, for the ``--validate`` types only). Medians are printed as a
Markdown table. ``--check`` also times ``hfrewrite check golden/`` with ``-j 1`` and ``-j 2``.
Not part of the shipped package.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TYPES = (
    "llama",
    "qwen3",
    "gemma3_text",
    "phi3",
    "qwen3_moe",
    "glm4_moe",
    "deepseek_v3",
    "granitemoe",
)

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import libcst as cst
from hfrewrite import convert
from hfrewrite.emit import output as emit
from hfrewrite.analyze.model import analyze
from hfrewrite.emit.pass_api import PassContext
from hfrewrite.emit.pipeline import run_passes
from hfrewrite.resolve import resolve
t1 = time.perf_counter()
resolved = resolve(sys.argv[1])
plan = analyze(resolved.config)
t2 = time.perf_counter()
module = cst.parse_module(resolved.modeling_path.read_text())
result = run_passes(module, PassContext(plan=plan, modeling_file=resolved.modeling_path.name))
t3 = time.perf_counter()
text = emit.render(resolved, result.module.code)
t4 = time.perf_counter()
out = {"import": t1 - t0, "analyze": t2 - t1, "rewrite": t3 - t2, "format": t4 - t3}
if sys.argv[2] == "1":
    from hfrewrite.verify.validate import validate
    validate(resolved, convert.Generated(f"{resolved.model_type}.py", text, result.fused, result.declined))
    out["validate"] = time.perf_counter() - t4
print(json.dumps(out))
"""

PHASES = ("import", "analyze", "rewrite", "format", "validate")


def time_type(model_type: str, reps: int, validate: bool) -> dict[str, float]:
    samples: dict[str, list[float]] = {}
    for _ in range(reps):
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, model_type, "1" if validate else "0"],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO,
        )
        for phase, seconds in json.loads(proc.stdout.strip().splitlines()[-1]).items():
            samples.setdefault(phase, []).append(seconds)
    return {phase: statistics.median(values) for phase, values in samples.items()}


def time_check(jobs: int) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "hfrewrite.cli", "check", "golden", "-j", str(jobs)],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=list(DEFAULT_TYPES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--validate", nargs="*", default=[], metavar="TYPE")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    print("| type | " + " | ".join(PHASES) + " | analyze + rewrite + format |")
    print("|---|" + "---|" * (len(PHASES) + 1))
    for model_type in args.types:
        medians = time_type(model_type, args.reps, model_type in args.validate)
        cells = [f"{medians[p]:.2f}" if p in medians else "" for p in PHASES]
        beyond = medians["analyze"] + medians["rewrite"] + medians["format"]
        print(f"| {model_type} | " + " | ".join(cells) + f" | {beyond:.2f} |", flush=True)
    if args.check:
        for jobs in (1, 2):
            print(
                f"\n`hfrewrite check golden/ -j {jobs}`: {time_check(jobs):.1f} s",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
