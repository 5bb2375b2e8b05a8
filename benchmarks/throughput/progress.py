"""Progress lines on stdout, stamped with the seconds since the run began."""

from __future__ import annotations

import time

_T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.0f} s] {msg}", flush=True)


def err_line(res: dict) -> str:
    lines = [ln for ln in res.get("error", "").strip().splitlines() if ln.strip()]
    return lines[-1].strip()[:300] if lines else ""
