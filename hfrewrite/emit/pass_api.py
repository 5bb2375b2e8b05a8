"""What every rewrite pass receives and returns.

A pass is a module in ``passes/`` with a docstring (pattern in, code out, preconditions),
``NAME`` and ``run(module, ctx) -> PassResult``. Passes never touch disk or run torch:
they return a new libcst tree plus requests (imports by symbol, fusion rows, NoMatch notes)
that the driver applies once.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from hfrewrite.analyze.plan import ModelPlan, NoMatch


@dataclass(frozen=True)
class FusionRow:
    module_class: str  # e.g. "LlamaAttention"
    fused: str  # e.g. "q_proj+k_proj+v_proj -> QKVParallelLinear"


@dataclass(frozen=True)
class PassContext:
    plan: ModelPlan
    modeling_file: str  # e.g. "modeling_llama.py", for comments and messages


@dataclass(frozen=True)
class PassResult:
    module: cst.Module
    imports: tuple[str, ...] = ()  # symbols known to hfrewrite.emit.target
    fused: tuple[FusionRow, ...] = ()
    declined: tuple[NoMatch, ...] = ()
    matches: int = 0  # how many times the pattern fired
