"""``python -m benchmarks.throughput``: the command line (run from the repository root)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import benchmarks.throughput as package
from benchmarks.throughput.driver import run
from benchmarks.throughput.report import render_markdown, write_outputs
from benchmarks.throughput.worker import worker_main
from benchmarks.throughput.workloads import MODELS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.throughput",
        description=package.__doc__.split("\n")[0],
    )
    parser.add_argument("--quick", action="store_true", help="small smoke configuration")
    parser.add_argument("--out", type=Path, default=None, help="write benchmarks.{md,json,png} here")
    parser.add_argument(
        "--models",
        nargs="+",
        default=[s.key for s in MODELS],
        choices=[s.key for s in MODELS],
    )
    parser.add_argument("--modes", nargs="+", default=["eager", "compile"], choices=["eager", "compile"])
    parser.add_argument("--reps", type=int, default=None, help="timed runs per variant")
    parser.add_argument("--convert-reps", type=int, default=1)
    parser.add_argument("--no-convert", action="store_true", help="skip convert timing")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per worker (OMP_NUM_THREADS; default: torch's default, one per core)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=840.0,
        help="wall seconds for the whole run; optional stages are skipped (and "
        "reported) when they would not fit (default 840)",
    )
    parser.add_argument("--render", type=Path, default=None, help="re-render from a benchmarks.json")
    parser.add_argument(
        "--findings",
        type=Path,
        default=None,
        help="with --render: a Markdown file kept in the results as their Findings",
    )
    parser.add_argument("--keep-tmp", action="store_true")
    parser.add_argument(
        "--generated",
        nargs="+",
        default=[],
        metavar="MODEL=FILE",
        help="benchmark FILE as the generated file of MODEL (llama, qwen3_moe, ...) "
        "instead of this run's `hfrewrite convert` output",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker)
    if args.render is not None:
        results = json.loads(args.render.read_text())
        if args.findings is not None:
            results["findings"] = args.findings.read_text()
        write_outputs(results, args.out or args.render.parent)
        return 0
    results = run(args)
    out = args.out or Path(tempfile.gettempdir()) / "hfrewrite-bench-out"
    write_outputs(results, out)
    text = render_markdown(results)
    print("\n## " + text.split("\n## ")[1] if "\n## " in text else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
