"""One conversion: resolved model -> analysis plan -> rewrite passes -> emitted text."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from hfrewrite.analyze.model import analyze
from hfrewrite.analyze.plan import NoMatch
from hfrewrite.emit import output as emit
from hfrewrite.emit.local_modules import inline_local_imports
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
    # (description, config) of the sibling configs whose branches the analysis proved
    sibling_configs: tuple[tuple[str, object], ...] = ()


def generate(resolved) -> Generated:
    """The generated vLLM file for a resolved model; nothing is written here."""
    with step("building and tracing a shrunk copy, proving replacements"):
        plan = analyze(resolved.config)
    try:
        module = cst.parse_module(resolved.modeling_path.read_text(encoding="utf-8"))
    except (OSError, cst.ParserSyntaxError) as exc:
        raise HfrewriteError(f"cannot read {resolved.modeling_path}: {exc}") from None
    if getattr(resolved, "custom_code", False):
        try:
            module = inline_local_imports(module, resolved.modeling_path.parent)
        except HfrewriteError as exc:
            raise HfrewriteError(f"{resolved.model_id}: {exc}") from None
        _defined_in_file(plan, module, resolved.modeling_path.name)
    with step(f"rewriting {resolved.modeling_path.name}"):
        result = run_passes(
            module,
            PassContext(
                plan=plan,
                modeling_file=resolved.modeling_path.name,
                custom_code=getattr(resolved, "custom_code", False),
            ),
        )
    with step("formatting"):
        text = emit.render(resolved, result.module.code)
    return Generated(
        filename=f"{resolved.model_type}.py",
        text=text,
        fused=result.fused,
        declined=result.declined,
        sibling_configs=plan.sibling_configs,
    )


def _defined_in_file(plan, module: cst.Module, filename: str) -> None:
    """Custom code whose model classes live in other files (a subclass of transformers'
    own classes) cannot be rewritten from the repository's file: say which class is missing."""
    defined = {node.name.value for node in module.body if isinstance(node, cst.ClassDef)}
    needed = [plan.architecture, plan.base_model_class, plan.decoder_layer.module_class]
    needed += [p.module_class for p in (plan.attention, plan.mlp, plan.moe) if p is not None]
    missing = [name for name in needed if name not in defined]
    if missing:
        raise HfrewriteError(
            f"{plan.model_type}: {missing[0]} is not defined in the repository's {filename} (it comes "
            "from another module): custom code is converted only from the file that defines its classes"
        )


# ``generate`` as defined here (tests may replace the module attribute; `check` then stays
# in-process, where the replacement is seen).
PIPELINE = generate
