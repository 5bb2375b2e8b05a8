"""Judge a generated vLLM model file against the references it must match.

A tiny random-weight Hugging Face checkpoint is decoded greedily three ways: by
Hugging Face ``generate`` (the reference), by vLLM running the generated model file,
and by vLLM's own implementation of the architecture (when it has one). The generated
file passes when its tokens equal both and its chosen-token logprobs agree within
``LOGPROB_TOL``. The structure of the loaded vLLM module (which fused parallel linear
layers each decoder layer uses) is reported next to vLLM's native structure.

``verify``/``verify_many`` run everything in one worker subprocess (``runner``), so
this module never imports vLLM: all Hugging Face runs happen first, then every vLLM
run builds one in-process ``LLM``, drops it and builds the next (``engine``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfrewrite.verify.engine import Tokens
from hfrewrite.verify.fixtures import DEFAULT_PROMPTS, checkpoint_architecture, uses_latent_attention
from hfrewrite.verify.runner import run_worker

LOGPROB_TOL = 1e-4
# vLLM's latent attention (MLA) computes in its absorbed form (W_UK folded into q, W_UV applied
# after the attention), another float32 summation order than transformers' expanded k and v. On
# DeepSeek's YaRN configs transformers' own float32 logprobs are up to 7.3e-05 from its float64
# ones on the tiny random checkpoints, so two correct float32 implementations differ by up to
# twice that (vLLM measured 1.1e-04 to 1.3e-04 on a CPU with AMX); a wrong file is off by 1e-2.
MLA_LOGPROB_TOL = 2e-4
# The same reasoning for any checkpoint: where transformers' own float32 logprobs are far from
# its float64 ones (unscaled attention scores, long MoE sums), convert-time validation allows
# twice that error (``measured_tolerance``), never more than this: a wrong file is off by 1e-2.
MAX_LOGPROB_TOL = 1e-3


def logprob_tolerance(ckpt: Path | str) -> float:
    """The float32 logprob tolerance for a checkpoint: wider for latent attention (MLA)."""
    return MLA_LOGPROB_TOL if uses_latent_attention(ckpt) else LOGPROB_TOL


def measured_tolerance(ckpt: Path | str, float32_error: float) -> float:
    """The tolerance for ``ckpt`` given transformers' own float32 error on it (its greedy
    logprobs against float64's): two correct float32 implementations may each be that far
    from exact, so twice it, within [``logprob_tolerance``, ``MAX_LOGPROB_TOL``]."""
    return min(max(logprob_tolerance(ckpt), 2 * float32_error), MAX_LOGPROB_TOL)


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of proving one generated model file on one checkpoint.

    Token/logprob fields are per prompt. ``native_*`` are None when vLLM has no
    native implementation of ``architecture``; ``logprob_diff_*`` are max |diff|
    of the chosen-token logprobs over the prefix where the tokens agree.
    """

    ckpt: str
    architecture: str
    generated_module: str
    hf_tokens: Tokens | None
    generated_tokens: Tokens | None
    native_tokens: Tokens | None
    logprob_diff_native: float | None
    logprob_diff_hf: float | None
    generated_structure: list[dict[str, int]] | None
    native_structure: list[dict[str, int]] | None
    generated_class: str | None
    ok: bool
    generated_file: str | None = None  # the file the class vLLM instantiated came from
    ran_file_under_test: bool = False  # that class is the generated file's own
    problems: tuple[str, ...] = ()
    # supports_pp, num_moe_layers
    generated_facts: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # run -> traceback text
    timings: dict[str, float] = field(default_factory=dict)
    logprob_tol: float = LOGPROB_TOL  # what the logprobs were held to (logprob_tolerance)
    # a run in bfloat16 judged on its first state layer instead (verify/state_layers.py): that
    # layer's output's largest difference from Hugging Face's, relative to its largest value
    state_layer_diff: float | None = None

    @property
    def structure_matches_native(self) -> bool | None:
        """Same per-layer linear-layer counts as vLLM's native model (None: no native)."""
        if self.native_structure is None or self.generated_structure is None:
            return None
        return self.generated_structure == self.native_structure

    def summary(self) -> str:
        """One paragraph for humans."""
        verdict = "OK" if self.ok else "FAILED"
        n = len(self.hf_tokens or [])
        parts = [
            f"{verdict}: {Path(self.generated_module).name} as {self.architecture} "
            + f"on {self.ckpt}, {n} prompts."
        ]
        if self.generated_class:
            name = self.generated_class.rsplit(".", 1)[-1]
            parts.append(f"vLLM instantiated {name} from {self.generated_file}.")
        if self.native_tokens is None:
            parts.append("vLLM has no native implementation to compare with.")

        def fmt(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.2e}"

        parts.append(
            f"max |logprob diff| vs native {fmt(self.logprob_diff_native)}, "
            f"vs HF {fmt(self.logprob_diff_hf)} (tolerance {self.logprob_tol:g})."
        )
        if self.generated_structure:
            parts.append(f"Decoder layer 0 linears: {_nonzero(self.generated_structure)}")
            if self.structure_matches_native is False:
                parts.append(f"(native: {_nonzero(self.native_structure)}).")
            elif self.structure_matches_native:
                parts.append("(same as native).")
        if self.problems:
            parts.append("Problems: " + "; ".join(self.problems) + ".")
        if self.timings:
            parts.append("Timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.timings.items()))
        return " ".join(parts)


def _nonzero(structure: list[dict[str, int]]) -> dict[str, int]:
    return {k: v for k, v in structure[0].items() if v} if structure else {}


@dataclass(frozen=True)
class VerifyCase:
    """One (checkpoint, generated file) pair for ``verify_many``."""

    ckpt: Path
    generated_module: Path
    architecture: str | None = None
    prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS
    max_tokens: int = 16
    dtype: str = "float32"  # both sides compute in it
    # the generated file's vLLM run alone (the reference stays float32): bfloat16 for a file
    # whose vLLM layers compute in no other on CPU (a gated delta net's kernel); its tokens
    # and logprobs are then reported, not judged (validate.py judges its first state layer)
    vllm_dtype: str = "float32"
    # more of vLLM's engine options for the generated file's run, as (name, value) pairs
    engine_options: tuple[tuple[str, Any], ...] = ()


def _max_diff(toks_a, lps_a, toks_b, lps_b) -> float | None:
    """Max |lp_a - lp_b| over each prompt's prefix where the tokens agree."""
    diffs = []
    for ta, la, tb, lb in zip(toks_a, lps_a, toks_b, lps_b):
        for x, y, p, q in zip(ta, tb, la, lb):
            if x != y:
                break
            diffs.append(abs(p - q))
    return max(diffs) if diffs else None


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first step where two greedy sequences differ (the shorter one's length when it is
    a prefix of the other), None when they are equal."""
    if list(a) == list(b):
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def logprobs_differ(reference: str, diff: float, tolerance: float) -> str:
    """The problem of logprobs ``diff`` away from ``reference``'s, past ``tolerance``."""
    return f"logprobs differ from {reference} by {diff:.2e} (tolerance {tolerance:.1e})"


def _first_mismatch(name: str, got: Tokens, want: Tokens) -> str | None:
    for i, (g, w) in enumerate(zip(got, want)):
        if (j := first_difference(g, w)) is not None:
            return f"prompt {i}: tokens differ from {name} at step {j} ({g[j : j + 3]} vs {w[j : j + 3]})"
    if len(got) != len(want):
        return f"{len(got)} outputs vs {len(want)} from {name}"
    return None


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else text


def _ran_file(run: dict) -> Path | None:
    """The file the class vLLM instantiated was defined in."""
    return Path(run["model_file"]).resolve() if run.get("model_file") else None


def _report(case: VerifyCase, arch: str, hf: dict, gen: dict, nat: dict | None, worker: dict) -> VerifyReport:
    """Judge one case from its three run results (``nat`` None: no native class)."""
    errors = {
        what: r["error"]
        for what, r in (("hf", hf), ("generated", gen), ("native", nat or {}))
        if "error" in r
    }
    problems = [f"{what} run failed: {_last_line(err)}" for what, err in errors.items()]
    hf_ok, gen_ok = "error" not in hf, "error" not in gen
    nat_ok = nat is not None and "error" not in nat
    diff_native = diff_hf = None
    tol = logprob_tolerance(case.ckpt)
    judged = case.vllm_dtype == "float32"  # by tokens and logprobs
    ran = _ran_file(gen) if gen_ok else None
    ran_file_under_test = (
        gen_ok
        and gen["model_class"].startswith("hfrewrite_generated_")
        and ran == Path(case.generated_module).resolve()
    )
    if gen_ok:
        if not ran_file_under_test:
            problems.append(
                f"vLLM ran {gen['model_class']} from {ran}, not the generated class of {case.generated_module}"
            )
        if nat_ok and not nat["model_class"].startswith("vllm.model_executor.models."):
            problems.append(f"native run used {nat['model_class']}, not vLLM's class")
        refs = [("HF", hf)] if hf_ok else []
        refs += [("native", nat)] if nat_ok else []
        for name, ref in refs if judged else ():
            if msg := _first_mismatch(name, gen["tokens"], ref["tokens"]):
                problems.append(msg)
        if hf_ok:
            diff_hf = _max_diff(gen["tokens"], gen["logprobs"], hf["tokens"], hf["logprobs"])
        if nat_ok:
            diff_native = _max_diff(gen["tokens"], gen["logprobs"], nat["tokens"], nat["logprobs"])
        for name, diff in (("native", diff_native), ("HF", diff_hf)) if judged else ():
            if diff is not None and diff > tol:
                problems.append(logprobs_differ(name, diff, tol))
    timings = {}
    for name, r in (("hf", hf), ("generated", gen), ("native", nat or {})):
        for key in ("seconds", "init_s", "gen_s"):
            if key in r:
                timings[f"{name}_{key}"] = r[key]
    for key in ("import_s", "wall_s"):
        if worker.get(key) is not None:
            timings[f"worker_{key}"] = worker[key]
    return VerifyReport(
        logprob_tol=tol,
        ckpt=str(case.ckpt),
        architecture=arch,
        generated_module=str(case.generated_module),
        hf_tokens=hf.get("tokens"),
        generated_tokens=gen.get("tokens"),
        native_tokens=nat.get("tokens") if nat_ok else None,
        logprob_diff_native=diff_native,
        logprob_diff_hf=diff_hf,
        generated_structure=gen.get("structure"),
        native_structure=nat.get("structure") if nat_ok else None,
        generated_class=gen.get("model_class"),
        generated_file=str(ran) if ran else None,
        ran_file_under_test=ran_file_under_test,
        generated_facts={k: gen.get(k) for k in ("supports_pp", "num_moe_layers")},
        ok=not problems,
        problems=tuple(problems),
        errors=errors,
        timings=timings,
    )


def verify_many(
    cases: Sequence[VerifyCase], timeout: float | None = None, native: bool = True
) -> list[VerifyReport]:
    """Verify several cases in one worker process (vLLM imported once).

    Per case: HF ``generate``, vLLM with the generated file, vLLM native (unless
    ``native`` is False: then HF is the only reference). HF and native runs shared by
    several cases (same checkpoint, prompts, length) run once.
    ``timeout`` (seconds, whole batch) defaults to 120 + 30 per run.
    """
    runs: list[dict[str, Any]] = []
    index: dict[str, int] = {}

    def add(run: dict[str, Any]) -> int:
        key = json.dumps(run, sort_keys=True)
        if key not in index:
            index[key] = len(runs)
            runs.append(run)
        return index[key]

    plan = []
    for case in cases:
        arch = case.architecture or checkpoint_architecture(case.ckpt)
        common = {
            "ckpt": str(case.ckpt),
            "prompts": [list(p) for p in case.prompts],
            "max_tokens": case.max_tokens,
            "architecture": arch,
        }
        if case.dtype != "float32":
            common["dtype"] = case.dtype
        hf = add({"kind": "hf", **common, "generated_module": None})
        engine = _engine_kwargs(case)
        gen = add(
            {
                "kind": "vllm",
                **common,
                **engine,
                "generated_module": str(case.generated_module),
            }
        )
        nat = add({"kind": "vllm", **common, **engine, "generated_module": None}) if native else None
        plan.append((case, arch, hf, gen, nat))
    if timeout is None:
        timeout = 120 + 30 * len(runs)  # measured: ~5 s per vLLM run, 2 busy cores
    results, info = run_worker(runs, timeout)
    reports = []
    for case, arch, hf, gen, nat in plan:
        native = None if nat is None or results[nat].get("unsupported") else results[nat]
        reports.append(_report(case, arch, results[hf], results[gen], native, info))
    return reports


def verify_against_hf(
    case: VerifyCase,
    hf: dict[str, Any],
    timeout: float | None = None,
    record: Path | None = None,
) -> VerifyReport:
    """Run ``case``'s generated file in a vLLM worker and judge it against ``hf``
    (``{"tokens", "logprobs"}`` computed by the caller, e.g. from a patched source);
    ``record``: see ``vllm_run``."""
    return verify_many_against_hf([case], [hf], [record], timeout)[0]


def verify_many_against_hf(
    cases: Sequence[VerifyCase],
    hfs: Sequence[dict[str, Any]],
    records: Sequence[Path | None] | None = None,
    timeout: float | None = None,
) -> list[VerifyReport]:
    """``verify_against_hf`` for several cases, their vLLM runs in one worker (vLLM imported
    once); ``timeout`` (whole batch) defaults to 120 + 30 per case."""
    records = list(records or [None] * len(cases))
    runs, archs = [], []
    for case, record in zip(cases, records):
        archs.append(case.architecture or checkpoint_architecture(case.ckpt))
        runs.append(
            {
                "kind": "vllm",
                "ckpt": str(case.ckpt),
                "prompts": [list(p) for p in case.prompts],
                "max_tokens": case.max_tokens,
                "architecture": archs[-1],
                "generated_module": str(case.generated_module),
                "record": str(record) if record else None,
                **_engine_kwargs(case),
            }
        )
    results, info = run_worker(runs, 120 + 30 * len(runs) if timeout is None else timeout)
    return [_report(c, a, hf, r, None, info) for c, a, hf, r in zip(cases, archs, hfs, results)]


def _engine_kwargs(case: VerifyCase) -> dict[str, Any]:
    """The vLLM runs' ``llm_kwargs``: their dtype where not float32, and the other options."""
    dtype = case.vllm_dtype if case.vllm_dtype != "float32" else case.dtype
    kwargs = {"dtype": dtype} if dtype != "float32" else {}
    kwargs.update(case.engine_options)
    return {"llm_kwargs": kwargs} if kwargs else {}


def verify(
    ckpt: Path,
    generated_module: Path,
    architecture: str | None = None,
    prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS,
    max_tokens: int = 16,
    timeout: float | None = None,
) -> VerifyReport:
    """Prove ``generated_module`` on ``ckpt``: tokens must equal HF's and vLLM
    native's, chosen-token logprobs within ``LOGPROB_TOL``. ``architecture`` defaults
    to the checkpoint's (the class name looked up in the generated file)."""
    case = VerifyCase(Path(ckpt), Path(generated_module), architecture, prompts, max_tokens)
    return verify_many([case], timeout)[0]
