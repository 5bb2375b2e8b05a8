"""docs/passes.md, built from the pass docstrings in registry order (`make docs`)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from hfrewrite.emit.pipeline import PASSES

INTRO = """\
# The rewrite passes

Each pass is one file in `passes/`, run in the order below (the registry in
`hfrewrite/emit/pipeline.py`, also printed by `hfrewrite --list-passes`). A pass reads the frozen
plan and returns a new libcst tree plus requests (imports by symbol, fusion rows); it never
runs torch or writes files. Where a precondition fails the pass raises with the reason and
nothing is written: hfrewrite refuses rather than emit a file that computes something else.
Tests: `tests/passes/test_<name>.py` (before/after pairs, refusals, must-not-change cases).
This page is generated from the docstrings by `make docs`; a test keeps it in sync.
"""


def render() -> str:
    parts = [INTRO]
    for i, p in enumerate(PASSES, 1):
        first, _, rest = textwrap.dedent(p.__doc__ or "").strip().partition("\n")
        parts.append(f"## {i}. `{p.NAME}` — {first.rstrip('.')}\n\n{rest.strip()}\n")
    return "\n".join(parts)


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(render(), encoding="utf-8")
