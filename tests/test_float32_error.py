"""The validation tolerance measured on each checkpoint: transformers' own float32 error
against float64 on the greedy sequences, doubled, within fixed bounds."""

from pathlib import Path

import pytest

from hfrewrite.verify import compare, engine
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
    assert errors["granitemoe_swa"] > 4 * errors["llama"]


def test_tolerance_is_twice_the_error_within_bounds():
    ckpt = Path("/nonexistent")  # not latent attention: the fixed floor is LOGPROB_TOL
    assert compare.measured_tolerance(ckpt, 1e-6) == compare.LOGPROB_TOL
    assert compare.measured_tolerance(ckpt, 1.5e-4) == pytest.approx(3e-4)
    assert compare.measured_tolerance(ckpt, 0.05) == compare.MAX_LOGPROB_TOL


def test_a_model_that_cannot_run_in_float64_keeps_the_fixed_tolerance(tmp_path):
    assert engine.hf_float32_error(tmp_path, DEFAULT_PROMPTS, [[1]], [[-1.0]]) == 0.0
