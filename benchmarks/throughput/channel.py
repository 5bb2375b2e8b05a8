"""The driver's end of the workers: a ``--worker`` subprocess and its command channel."""

from __future__ import annotations

import json
import selectors
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.throughput.progress import err_line, say
from benchmarks.throughput.workloads import REPO


class Worker:
    """A ``--worker`` subprocess and its command channel."""

    def __init__(self, impl: str, env: dict, log: Path) -> None:
        self.name = impl
        self.log_path = log
        self.import_s: float | None = None
        self._log = open(log, "w")  # noqa: SIM115  (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.throughput", "--worker", impl],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
            cwd=REPO,
        )
        self.dead: str | None = None

    def call(self, op: str, timeout: float, **args: Any) -> dict:
        """Run ``op`` in the worker; its JSON answer, or ``{"error": ...}``."""
        return self.send(op, **args) or self.receive(op, timeout)

    def send(self, op: str, **args: Any) -> dict | None:
        if self.dead:
            return {"error": self.dead}
        try:
            self.proc.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return self._died(f"{self.name}: worker exited before {op}")
        return None

    def receive(self, op: str, timeout: float) -> dict:
        if self.dead:
            return {"error": self.dead}
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout)
        sel.close()
        if not ready:
            self.proc.kill()
            return self._died(f"{self.name}: {op} timed out after {timeout:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            return self._died(f"{self.name}: worker exited during {op}")
        return json.loads(line)

    def _died(self, why: str) -> dict:
        self.proc.wait(timeout=30)
        self.dead = f"{why} (exit {self.proc.returncode}); log tail:\n{self.log_tail()}"
        return {"error": self.dead}

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None and not self.dead:
            self.call("quit", 30)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def start_workers(env: dict, logs: Path, names: Sequence[str]) -> dict[str, Worker]:
    """One worker per variant; they import their libraries side by side (nothing is
    timed then but the imports themselves)."""
    workers = {n: Worker(n, env, logs / f"worker-{n}.log") for n in names}
    sent = {n: w.send("import") for n, w in workers.items()}
    for n, w in workers.items():
        r = sent[n] or w.receive("import", 600)
        w.import_s = r.get("import_s")
        if "error" in r:
            say(f"worker {n}: import failed: {err_line(r)}")
    return workers
