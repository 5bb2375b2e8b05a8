"""The facts an isolated analysis hands back, and the two jobs this process asks of it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfrewrite.isolate.client import run_front
from hfrewrite.isolate.environment import choose_version, ensure_overlay
from hfrewrite.progress import step


@dataclass(frozen=True)
class IsolatedAnalysis:
    version: str  # the transformers release the repository's code ran under
    why: str  # why that release ("named by config.json", "asked for", ...)
    plan: Any  # ModelPlan; sibling configs as (description, config dict)
    config_data: dict  # the repository's config as its own class builds it (to_dict)
    config_class: str  # the repository's configuration class, e.g. "InternLM2Config"
    config_path: Path  # its source file
    modeling_path: Path
    modeling_module: str


def analyze_isolated(
    model_id: str, revision: str | None, data: dict, requested: str | None
) -> IsolatedAnalysis:
    """Resolve and analyse the repository under the transformers release it was written for."""
    version, why = choose_version(data, requested)
    ensure_overlay(version)  # its own progress line, before the analysis's
    job = {"kind": "analyze", "model_id": model_id, "revision": revision}
    with step(f"building and tracing a shrunk copy under transformers {version} ({why})"):
        result = run_front(version, job)
    return IsolatedAnalysis(
        version=version,
        why=why,
        plan=result["plan"],
        config_data=result["config"],
        config_class=result["config_class"],
        config_path=Path(result["config_path"]),
        modeling_path=Path(result["modeling_path"]),
        modeling_module=result["modeling_module"],
    )


def isolated_references(
    isolated: IsolatedAnalysis,
    model_id: str,
    revision: str | None,
    configs: list[tuple[str, dict | None]],
    prompts,
    max_tokens: int,
    out_dir: Path,
) -> list[dict]:
    """Per (description, config dict or None for the repository's own): the tiny checkpoint
    the repository's code saved under ``out_dir``, its prompts, the greedy tokens and
    logprobs of Hugging Face under that release, and the config values its class loads."""
    job = {
        "kind": "references",
        "model_id": model_id,
        "revision": revision,
        "configs": configs,
        "prompts": [list(p) for p in prompts],
        "max_tokens": max_tokens,
        "out_dir": str(out_dir),
    }
    return run_front(isolated.version, job)["references"]
