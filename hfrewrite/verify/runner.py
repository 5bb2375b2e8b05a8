"""The subprocess side of verification: the caller's end of ``hfrewrite.verify.worker``.

``run_worker`` executes one batch of runs in a fresh worker process; ``VllmServer``
keeps one worker alive for many runs. Either way vLLM is imported in the worker,
never in the caller, and once per process however many checkpoints it decodes.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hfrewrite.verify.engine import vllm_env


def run_worker(
    runs: Sequence[dict[str, Any]],
    timeout: float = 900,
    env: dict[str, str] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Execute ``runs`` in one ``hfrewrite.verify.worker`` subprocess.

    Each run is ``{"kind": "hf" | "vllm", "ckpt", "prompts", "max_tokens",
    "generated_module", "architecture"}``, vLLM runs optionally with
    ``"as_registered": true`` and ``"llm_kwargs": {...}`` (see ``vllm_run``). ``env``
    overrides the worker's environment (``PYTHONPATH`` for a plugin or a vLLM tree,
    ``VLLM_CPU_OMP_THREADS_BIND`` for tensor parallelism). Returns one result per run
    (``{"error": ...}`` for a run that raised or never ran) and worker info
    (``import_s``, ``wall_s``, ``returncode``, ``stderr_tail``, ``mq_connect_ips``).
    """
    with tempfile.TemporaryDirectory(prefix="hfrewrite-verify-") as tmp:
        tmp = Path(tmp)
        job, out = tmp / "job.json", tmp / "out.json"
        job.write_text(json.dumps({"runs": list(runs)}, default=str))
        env = {
            **os.environ,
            **{k: v for k, v in vllm_env(tmp / "vllm-cache").items() if k not in os.environ},
            **(env or {}),
        }
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "hfrewrite.verify.worker", str(job), str(out)],
                check=False,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            rc, stderr = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            out_err = (exc.stdout or b"") + (exc.stderr or b"")  # bytes, even if text
            if isinstance(out_err, bytes):
                out_err = out_err.decode(errors="replace")
            rc, stderr = None, f"{out_err}\nworker timed out after {timeout} s"
        wall = time.perf_counter() - t0
        data = json.loads(out.read_text()) if out.exists() else {}
    results = data.get("results") or [None] * len(runs)
    tail = stderr[-4000:]
    # the whole log, e.g. a worker's native stack
    if os.environ.get("HFREWRITE_WORKER_LOG"):
        Path(os.environ["HFREWRITE_WORKER_LOG"]).write_text(stderr)
    missing = {"error": f"worker exited ({rc}) before this run:\n{tail}"}
    results = [missing if r is None else r for r in results]
    info = {
        "import_s": data.get("import_s"),
        "wall_s": wall,
        "returncode": rc,
        "stderr_tail": tail,
        # where multi-process runs' message queues connected (vLLM logs it)
        "mq_connect_ips": sorted(set(re.findall(r"mq_connect_ip=([\w.:]+)", stderr))),
    }
    return results, info


class VllmServer:
    """One long-lived vLLM worker process for many runs (vLLM imported once): what the
    config fuzzer uses. ``run`` sends one vLLM run (the ``run_worker`` dict without
    ``kind``) and returns its result; vLLM's own output goes to ``log``."""

    def __init__(self, log: Path, env: dict[str, str] | None = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="hfrewrite-vllm-server-")
        read, write = os.pipe()
        env = {
            **os.environ,
            **{k: v for k, v in vllm_env(Path(self._tmp.name) / "vllm-cache").items() if k not in os.environ},
            **(env or {}),
        }
        self._log = open(log, "w")  # noqa: SIM115  (closed in close())
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "hfrewrite.verify.worker", "--serve", str(write)],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            pass_fds=(write,),
        )
        os.close(write)
        self._results = os.fdopen(read)

    def run(self, run: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
        self._proc.stdin.write(json.dumps(run, default=str) + "\n")
        self._proc.stdin.flush()
        ready, _, _ = select.select([self._results], [], [], timeout)
        line = self._results.readline() if ready else ""
        if not line:
            self.close()
            return {
                "error": f"the vLLM worker {'timed out' if not ready else 'exited'}; see {self._log.name}"
            }
        return json.loads(line)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._results.close()
        self._log.close()
        self._tmp.cleanup()
