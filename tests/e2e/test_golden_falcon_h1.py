"""The Falcon-H1 golden, proved in real vLLM: every layer runs attention and a Mamba-2 mixer
side by side on one norm's output (vLLM's ``Attention`` and its ``MambaMixer2`` with the
states it caches), then its MLP; Falcon-H1's muP multipliers everywhere: on the embeddings,
the mixer's input and each block of its input projection's columns (vLLM's ``mup_vector``,
cut per rank), the attention's input and keys, both blocks' outputs, the MLP's gate and
output, and the logits.

Tiny float32 checkpoints: greedy tokens equal Hugging Face's, chosen-token logprobs within
1e-4, with every multiplier at 1 (the default config the golden was traced on) and with
each one its own (so that one the file dropped or misplaced shows); and equal to vLLM's own
``falcon_h1.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hfrewrite.verify.compare import LOGPROB_TOL, VerifyCase, verify_many
from hfrewrite.verify.fixtures import make_tiny_checkpoint

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
# four Mamba-2 heads of 32 channels, a 16-wide state, one group
SIZES = {
    "mamba_n_heads": 4,
    "mamba_d_head": 32,
    "mamba_d_ssm": 128,
    "mamba_d_state": 16,
    "mamba_chunk_size": 4,
}
MULTIPLIERS = {
    "embedding_multiplier": 1.7,
    "lm_head_multiplier": 0.6,
    "key_multiplier": 0.8,
    "attention_in_multiplier": 1.3,
    "attention_out_multiplier": 0.9,
    "ssm_in_multiplier": 1.2,
    "ssm_out_multiplier": 0.7,
    "ssm_multipliers": [0.5, 1.4, 0.8, 1.1, 0.6],
    "mlp_multipliers": [1.25, 0.75],
}
CASES: dict[str, dict] = {
    "falcon_h1-defaults": SIZES,
    "falcon_h1-mup": {**SIZES, **MULTIPLIERS},
    "falcon_h1-mup-tied": {**SIZES, **MULTIPLIERS, "tie_word_embeddings": True},
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cases = [
        VerifyCase(
            make_tiny_checkpoint(
                "falcon_h1", tmp_path_factory.mktemp(name), seed=i, num_hidden_layers=3, **overrides
            ),
            GOLDEN / "falcon_h1.py",
        )
        for i, (name, overrides) in enumerate(CASES.items())
    ]
    return dict(zip(CASES, verify_many(cases)))


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_falcon_h1_golden_matches_hf_and_vllm_native(reports, case):
    report = reports[case]
    assert report.hf_tokens and len(set(report.hf_tokens[3])) > 4, "greedy decoding degenerated into repeats"
    assert report.generated_tokens == report.hf_tokens, report.summary()
    assert report.logprob_diff_hf is not None and report.logprob_diff_hf <= LOGPROB_TOL, report.summary()
    assert report.generated_class.startswith("hfrewrite_generated_"), report.summary()
    assert report.native_tokens == report.hf_tokens, report.summary()
    assert report.logprob_diff_native is not None and report.logprob_diff_native <= LOGPROB_TOL, (
        report.summary()
    )
    assert report.problems == (), report.summary()
