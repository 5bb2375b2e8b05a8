"""The pass registry and the runner: order, imports once, match counts, failures that name the pass."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import libcst as cst

from hfrewrite.analyze.plan import NoMatch
from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pass_api import FusionRow, PassContext
from hfrewrite.emit.target import import_of
from hfrewrite.errors import HfrewriteError
from hfrewrite.passes import (
    block_kinds,
    carry_decoder_layer,
    composite_text,
    config_guards,
    drop_dead_locals,
    flatten_base_model,
    fuse_experts,
    fuse_gate_up,
    fuse_qkv,
    fused_residual_norm,
    hybrid_mixer,
    inline_helpers,
    load_weights,
    mla_attention,
    moe_interface,
    parallel_embedding,
    parallel_sequential,
    prune_unused_params,
    row_parallel,
    stale_docstrings,
    strip_hf_runtime,
    taken_branches,
    thread_layer_args,
    type_config_params,
    vllm_attention,
    vllm_model_interface,
)

# The one place that orders the passes; `hfrewrite convert --list-passes` prints this.
PASSES: tuple[ModuleType, ...] = (
    flatten_base_model,  # first: the other passes find the parts where a flat model has them
    taken_branches,
    block_kinds,  # before the passes that find each block's class built by name
    inline_helpers,
    carry_decoder_layer,
    fuse_qkv,
    vllm_attention,
    mla_attention,
    fuse_experts,  # before fuse_gate_up: it reads the experts' class as the source has it
    fuse_gate_up,
    row_parallel,
    parallel_sequential,  # before thread_layer_args: the layer's __init__ reads quant_config
    fused_residual_norm,
    parallel_embedding,
    vllm_model_interface,
    moe_interface,
    hybrid_mixer,  # before thread_layer_args: the layer's __init__ reads cache_config
    thread_layer_args,
    load_weights,
    strip_hf_runtime,
    config_guards,  # after the dead code went: a test only dead code made is no longer made
    prune_unused_params,
    drop_dead_locals,
    stale_docstrings,  # after the parameters went
    type_config_params,
    composite_text,  # last: the text classes read hf_text_config, typed as the others
)


@dataclass(frozen=True)
class RewriteResult:
    module: cst.Module
    fused: tuple[FusionRow, ...]
    declined: tuple[NoMatch, ...]  # the plan's: a pass refuses what it cannot rewrite
    matches: dict[str, int]  # pass NAME -> the sites it rewrote (PassResult.matches)


def describe(p: ModuleType) -> str:
    """First line of a pass's docstring."""
    return (p.__doc__ or "").strip().splitlines()[0]


def run_passes(module: cst.Module, ctx: PassContext) -> RewriteResult:
    imports: set[str] = set()
    fused: list[FusionRow] = []
    matches: dict[str, int] = {}
    for p in PASSES:
        try:
            result = p.run(module, ctx)
        except HfrewriteError:
            raise
        except Exception as exc:  # a bug in a pass: name it
            raise RuntimeError(f"pass {p.NAME} failed: {exc!r}") from exc
        module = result.module
        imports.update(result.imports)
        fused.extend(result.fused)
        matches[p.NAME] = result.matches
    return RewriteResult(add_imports(module, imports), tuple(fused), ctx.plan.declined, matches)


def add_imports(module: cst.Module, symbols: set[str]) -> cst.Module:
    """One `from m import a, b` per module, after the last top-level import (sorted later by ruff)."""
    by_module: dict[str, list[str]] = {}
    for symbol in sorted(symbols):
        mod, name = import_of(symbol)
        by_module.setdefault(mod, []).append(name)
    lines = "".join(f"from {m} import {', '.join(names)}\n" for m, names in sorted(by_module.items()))
    body = list(module.body)
    last = max(
        (
            i
            for i, n in enumerate(body)
            if isinstance(n, cst.SimpleStatementLine) and isinstance(n.body[0], (cst.Import, cst.ImportFrom))
        ),
        default=-1,
    )
    return module.with_changes(body=[*body[: last + 1], *t.stmts(lines), *body[last + 1 :]])
