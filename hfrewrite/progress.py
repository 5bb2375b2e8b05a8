"""Progress lines for the slow steps of ``convert``, on a terminal only.

``with step("tracing a shrunk copy"):`` prints ``hfrewrite: tracing a shrunk copy ...`` to
stderr, then `` done (1.2 s)``. Quiet unless stderr is a terminal and ``CI`` is unset;
``HFREWRITE_PROGRESS=1`` forces it on (tests), ``=0`` off. stdout (the fusion table) and
the error contract (one line, non-zero exit) are untouched.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


def enabled() -> bool:
    forced = os.environ.get("HFREWRITE_PROGRESS")
    if forced is not None:
        return forced == "1"
    return sys.stderr.isatty() and not os.environ.get("CI")


@contextmanager
def step(what: str) -> Iterator[None]:
    if not enabled():
        yield
        return
    start = time.perf_counter()
    try:  # (the line printed inside: an interrupt right after it still marks it failed)
        print(f"hfrewrite: {what} ...", end="", file=sys.stderr, flush=True)
        yield
    except BaseException:
        print(" failed", file=sys.stderr, flush=True)
        raise
    print(f" done ({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
