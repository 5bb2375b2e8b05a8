"""Run one job of ``front.py`` in a child process under a transformers overlay."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

from hfrewrite.errors import HfrewriteError
from hfrewrite.isolate.environment import ensure_overlay

TIMEOUT = 1800  # seconds: an analysis with sibling configs, or a batch of reference decodes


def run_front(version: str, job: dict) -> dict:
    """The result of ``job`` run under transformers ``version`` (installed first if needed);
    a failure in the child is one ``HfrewriteError`` line."""
    overlay = ensure_overlay(version)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(overlay), env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory(prefix="hfrewrite-isolated-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.pkl"
        job_path.write_text(json.dumps(job))
        done = subprocess.run(
            [sys.executable, "-m", "hfrewrite.isolate.front", str(job_path), str(out_path)],
            env=env,
            check=False,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        if not out_path.is_file():
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise HfrewriteError(f"the analysis under transformers {version} failed: {tail}")
        result = pickle.loads(out_path.read_bytes())
    if "error" in result:
        raise HfrewriteError(f"{result['error']} (under transformers {version})")
    return result
