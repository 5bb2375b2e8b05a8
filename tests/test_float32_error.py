"""The validation tolerance measured on each checkpoint: transformers' own float32 error
against float64 on the greedy sequences, doubled, within fixed bounds."""

from pathlib import Path

import pytest

from hfrewrite.verify import compare, engine, validate
from hfrewrite.verify.fixtures import DEFAULT_PROMPTS, make_tiny_checkpoint


@pytest.fixture(scope="module")
def errors(tmp_path_factory) -> dict[str, float]:
    measured = {}
    # granitemoe_swa's default muP-free config scales the scores by 1.0, not 1/sqrt(head_dim):
    # its float32 logits are far noisier than llama's
    for model_type in ("llama", "granitemoe_swa"):
        ckpt = make_tiny_checkpoint(model_type, tmp_path_factory.mktemp(model_type), seed=0)
        tokens, logprobs = engine.hf_greedy(ckpt, DEFAULT_PROMPTS)
        measured[model_type] = engine.hf_float32_error(ckpt, DEFAULT_PROMPTS, tokens, logprobs)
    return measured


def test_float32_error_is_measured_against_float64(errors):
    assert 0 < errors["llama"] < compare.LOGPROB_TOL / 2
    # a MoE model runs in float64 too (its experts one by one), and is measured noisier
    assert errors["granitemoe_swa"] > 3 * errors["llama"]


def test_tolerance_is_twice_the_error_within_bounds():
    ckpt = Path("/nonexistent")  # not latent attention: the fixed floor is LOGPROB_TOL
    assert compare.measured_tolerance(ckpt, 1e-6) == compare.LOGPROB_TOL
    assert compare.measured_tolerance(ckpt, 1.5e-4) == pytest.approx(3e-4)
    assert compare.measured_tolerance(ckpt, 0.05) == compare.MAX_LOGPROB_TOL


def test_a_model_that_cannot_run_in_float64_keeps_the_fixed_tolerance(tmp_path):
    assert engine.hf_float32_error(tmp_path, DEFAULT_PROMPTS, [[1]], [[-1.0]]) == 0.0


def _failed_by_logprobs(ckpt: Path, diff: float, **changes) -> compare.VerifyReport:
    tokens = [[1, 2, 3]]
    fields = {
        "ckpt": str(ckpt),
        "architecture": "X",
        "generated_module": "x.py",
        "hf_tokens": tokens,
        "generated_tokens": tokens,
        "native_tokens": None,
        "logprob_diff_native": None,
        "logprob_diff_hf": diff,
        "generated_structure": None,
        "native_structure": None,
        "generated_class": "hfrewrite_generated_x.X",
        "ok": False,
        "ran_file_under_test": True,
        "problems": (f"logprobs differ from HF by {diff:.2e}",),
    }
    return compare.VerifyReport(**{**fields, **changes})


@pytest.mark.parametrize(("error", "diff", "ok"), [(1.4e-4, 1.3e-4, True), (1.4e-4, 3.0e-4, False)])
def test_a_logprob_only_failure_is_judged_again_at_the_measured_tolerance(monkeypatch, error, diff, ok):
    monkeypatch.setattr(engine, "hf_float32_error", lambda *args: error)
    case = compare.VerifyCase(Path("/nonexistent"), Path("x.py"), prompts=[[5]])
    report = validate._measured(
        _failed_by_logprobs(case.ckpt, diff), case, {"tokens": [[1]], "logprobs": [[-1.0]]}
    )
    assert report.ok is ok and report.logprob_tol == pytest.approx(2 * error)
    assert report.problems == (() if ok else (f"logprobs differ from HF by {diff:.2e} (tolerance 2.8e-04)",))


def test_other_failures_are_not_measured(monkeypatch):
    monkeypatch.setattr(engine, "hf_float32_error", lambda *args: pytest.fail("measured"))
    case = compare.VerifyCase(Path("/nonexistent"), Path("x.py"), prompts=[[5]])
    for report in (
        _failed_by_logprobs(case.ckpt, 1.3e-4, generated_tokens=[[1, 2, 4]]),  # tokens differ
        _failed_by_logprobs(case.ckpt, 1.3e-4, ran_file_under_test=False),
        _failed_by_logprobs(case.ckpt, 5e-3),  # beyond any measured tolerance
    ):
        assert validate._measured(report, case, {"tokens": [[1]], "logprobs": [[-1.0]]}) is report
