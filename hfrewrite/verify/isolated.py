"""Validation of a file whose analysis ran under another transformers release.

The tiny checkpoints and the Hugging Face references come from the repository's own code
under that release (``isolate/front.py``: greedy decoding by full recompute); the config
shim the file carries must load each checkpoint's config.json to the values the
repository's class does; then the file runs in the installed vLLM on each checkpoint.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import libcst as cst

from hfrewrite.errors import HfrewriteError


def validate_isolated(resolved, generated, named: list[tuple[str, object]]) -> list[tuple[str, object, str]]:
    """``validate_each`` for an isolated analysis: (description, report, "") per config."""
    from hfrewrite.isolate.analysis import isolated_references
    from hfrewrite.verify import compare, fixtures

    iso = generated.isolated
    configs = [(what, None if i == 0 else _as_dict(config)) for i, (what, config) in enumerate(named)]
    with tempfile.TemporaryDirectory(prefix="hfrewrite-validate-") as tmp:
        tmp = Path(tmp)
        module = tmp / generated.filename
        module.write_text(generated.text)
        refs = isolated_references(
            iso, resolved.location, resolved.revision, configs, fixtures.DEFAULT_PROMPTS, 16, tmp
        )
        shim = shim_class(iso, resolved.model_type)
        for ref in refs:
            check_shim(shim, Path(ref["ckpt"]), ref["config_values"], ref["what"], resolved.model_type)
        cases = [compare.VerifyCase(Path(r["ckpt"]), module, prompts=r["prompts"]) for r in refs]
        reports = compare.verify_many_against_hf(cases, refs)
        return [(what, report, "") for (what, _), report in zip(named, reports)]


def _as_dict(config) -> dict:
    return config if isinstance(config, dict) else config.to_dict()


def shim_class(iso, model_type: str) -> type:
    """The config shim the file carries, executed alone (it needs only transformers)."""
    from hfrewrite.emit.config_shim import shim_statements

    sizes = iso.plan.vllm_sizes if getattr(iso, "plan", None) is not None else ()
    code = cst.Module(body=shim_statements(iso.config_path, iso.config_class, model_type, sizes)).code
    namespace: dict = {"__name__": f"hfrewrite_config_shim_{model_type}"}
    try:
        exec(compile(code, str(iso.config_path), "exec"), namespace)  # noqa: S102 - the repository's class
    except Exception as exc:  # noqa: BLE001
        line = (str(exc).strip().splitlines() or [""])[0]
        raise HfrewriteError(
            f"{model_type}: the repository's configuration class does not load under the installed "
            f"transformers even as a shim: {type(exc).__name__}: {line}"
        ) from None
    return namespace[iso.config_class]


def check_shim(shim: type, ckpt: Path, expected: dict, what: str, model_type: str) -> None:
    """The shim loads ``ckpt``'s config.json to the values the repository's class does."""
    from transformers import GenerationConfig

    data = json.loads((ckpt / "config.json").read_text())
    config = shim.from_dict(data)
    # (a size the shim computes is a property: analyze/vllm_sizes.py)
    found = {**{k: getattr(config, k) for k in expected if hasattr(type(config), k)}, **vars(config)}
    loaded = json.loads(json.dumps(found, default=repr, sort_keys=True))
    # transformers 5 pops generation parameters (ChatGLM3's use_cache) from configs it loads:
    # they build nothing
    generation = set(GenerationConfig._get_default_generation_params())
    for key, value in sorted(expected.items()):
        if key not in generation and loaded.get(key, "<missing>") != value:
            raise HfrewriteError(
                f"{model_type}: the config shim loads {key}={loaded.get(key, '<missing>')!r} where the "
                f"repository's class under its transformers loads {value!r} ({what}); nothing written"
            )
