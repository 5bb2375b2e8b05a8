"""One conversion: resolved model -> analysis plan -> rewrite passes -> emitted text."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from hfrewrite.analyze.model import analyze
from hfrewrite.analyze.plan import NoMatch
from hfrewrite.emit import output as emit
from hfrewrite.emit.pass_api import FusionRow, PassContext
from hfrewrite.emit.pipeline import run_passes
from hfrewrite.errors import HfrewriteError
from hfrewrite.progress import step


@dataclass(frozen=True)
class Generated:
    filename: str  # "<model_type>.py"
    text: str  # the final file: header + formatted source
    fused: tuple[FusionRow, ...]
    declined: tuple[NoMatch, ...]


def generate(resolved) -> Generated:
    """The generated vLLM file for a resolved model; nothing is written here."""
    with step("building and tracing a shrunk copy, proving replacements"):
        plan = analyze(resolved.config)
    if getattr(resolved, "custom_code", False):
        raise HfrewriteError(
            f"{resolved.model_id}: the analysis proves this custom code, but writing a vLLM file for "
            f"custom code is not implemented yet (the file would import {type(resolved.config).__name__}, "
            "which exists only in the repository's code)"
        )
    try:
        module = cst.parse_module(resolved.modeling_path.read_text(encoding="utf-8"))
    except (OSError, cst.ParserSyntaxError) as exc:
        raise HfrewriteError(f"cannot read {resolved.modeling_path}: {exc}") from None
    with step(f"rewriting {resolved.modeling_path.name}"):
        result = run_passes(module, PassContext(plan=plan, modeling_file=resolved.modeling_path.name))
    with step("formatting"):
        text = emit.render(resolved, result.module.code)
    return Generated(
        filename=f"{resolved.model_type}.py",
        text=text,
        fused=result.fused,
        declined=result.declined,
    )


# ``generate`` as defined here (tests may replace the module attribute; `check` then stays
# in-process, where the replacement is seen).
PIPELINE = generate
