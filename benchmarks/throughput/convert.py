"""``hfrewrite convert`` wall time per model type, in fresh processes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.throughput.progress import say
from benchmarks.throughput.workloads import REPO


def _hfrewrite_cmd() -> list[str]:
    script = Path(sys.executable).parent / "hfrewrite"
    return [str(script)] if script.exists() else [sys.executable, "-m", "hfrewrite.cli"]


def bench_convert(types: Sequence[str], tmp: Path, reps: int, env: dict) -> dict:
    """Wall time of ``hfrewrite convert TYPE`` per type (``reps`` runs, interleaved),
    next to ``python -c "import torch, transformers"``."""
    result: dict[str, Any] = {"types": {}, "import_baseline_s": []}
    outputs = {t: tmp / f"convert-{t}" for t in types}
    for rep in range(reps):
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", "import torch, transformers"],
            env=env,
            check=False,
            capture_output=True,
        )
        result["import_baseline_s"].append(time.perf_counter() - t0)
        for t in types:
            entry = result["types"].setdefault(t, {"samples": [], "ok": True})
            t0 = time.perf_counter()
            proc = subprocess.run(
                [
                    *_hfrewrite_cmd(),
                    "convert",
                    t,
                    "-o",
                    str(outputs[t]),
                    "--force",
                    "--no-verify",
                ],
                env=env,
                check=False,
                capture_output=True,
                text=True,
            )
            entry["samples"].append(time.perf_counter() - t0)
            if proc.returncode != 0:
                entry["ok"] = False
                entry["error"] = (proc.stderr or proc.stdout)[-800:]
            say(f"convert {t}: {entry['samples'][-1]:.1f} s (rc {proc.returncode})")
    for t, entry in result["types"].items():
        out = outputs[t] / f"{t}.py"
        golden = REPO / "golden" / f"{t}.py"
        entry["output"] = str(out) if out.exists() else None
        if out.exists() and golden.exists():
            entry["same_as_golden"] = out.read_bytes() == golden.read_bytes()
    return result
