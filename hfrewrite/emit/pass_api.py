"""What every rewrite pass receives and returns.

A pass is a module in ``passes/`` with a docstring (pattern in, code out, preconditions),
``NAME`` and ``run(module, ctx) -> PassResult``. Passes never touch disk or run torch:
they return a new libcst tree plus requests (imports by symbol, fusion rows) that the
driver applies once, and how many sites they rewrote. A site a pass cannot rewrite is
refused (``HfrewriteError``); what analysis declined is in ``ModelPlan.declined``.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from hfrewrite.analyze.plan import ModelPlan
from hfrewrite.emit import cst_tools as t


@dataclass(frozen=True)
class FusionRow:
    module_class: str  # e.g. "LlamaAttention"
    fused: str  # e.g. "q_proj+k_proj+v_proj -> QKVParallelLinear"


@dataclass(frozen=True)
class PassContext:
    plan: ModelPlan
    modeling_file: str  # e.g. "modeling_llama.py", for comments and messages
    # Hub custom code: the configuration class exists only in the repository's code,
    # which vLLM loads itself (trust_remote_code); the file cannot import it
    custom_code: bool = False
    # names the config shim defines beside the configuration class (the repository's helpers,
    # OpenELM's make_divisible): the converted code keeps using them
    shim_helpers: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PassResult:
    module: cst.Module
    imports: tuple[str, ...] = ()  # symbols known to hfrewrite.emit.target
    fused: tuple[FusionRow, ...] = ()
    matches: int = 0  # how many sites the pass rewrote, counted as it rewrote them


class Sites:
    """Counts the sites a pass rewrites as it rewrites them: its ``PassResult.matches``."""

    def __init__(self) -> None:
        self.count = 0

    def replace_class(self, module: cst.Module, name: str, new: cst.ClassDef) -> cst.Module:
        """``module`` with its top-level class ``name`` replaced by ``new``, one site per class replaced."""
        self.count += sum(isinstance(n, cst.ClassDef) and n.name.value == name for n in module.body)
        return t.replace_class(module, name, new)
