"""The checked-in golden files, proved in real vLLM.

One generated file per model type must be right for every config of that type, so each
golden runs on several tiny checkpoints (GQA/MQA/MHA, biases, explicit head_dim, rope
scaling, tied and untied lm_head). Every case: greedy tokens equal Hugging Face's and vLLM
native's, chosen-token logprobs within 1e-4, and per decoder layer one QKVParallelLinear,
one MergedColumnParallelLinear, two RowParallelLinear and no plain nn.Linear.
All cases run in one vLLM worker process (vLLM imported once).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hfrewrite.verify.compare import LOGPROB_TOL, VerifyCase, verify_many
from hfrewrite.verify.fixtures import make_tiny_checkpoint

GOLDEN = Path(__file__).resolve().parents[2] / "golden"

CASES: dict[str, tuple[str, dict]] = {
    "llama-gqa-untied": ("llama", {}),
    "llama-tied-attn-bias-mlp-bias": (
        "llama",
        {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    ),
    "llama-head-dim-64-mqa": ("llama", {"head_dim": 64, "num_key_value_heads": 1}),
    "llama-mha-rope-linear": (
        "llama",
        {
            "num_key_value_heads": 4,
            "rope_parameters": {
                "rope_type": "linear",
                "factor": 2.0,
                "rope_theta": 10000.0,
            },
        },
    ),
    # a window shorter than the longer prompts (up to 56 tokens with the generated ones)
    "mistral-gqa-sliding-window": ("mistral", {"sliding_window": 8}),
    "qwen2-bias-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-qk-norm": ("qwen3", {}),
    "qwen3-qk-norm-tied-mqa": (
        "qwen3",
        {"tie_word_embeddings": True, "num_key_value_heads": 1},
    ),
}

EXPECTED_LAYER = {
    "QKVParallelLinear": 1,
    "MergedColumnParallelLinear": 1,
    "RowParallelLinear": 2,
    "Linear": 0,
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cases = []
    for name, (model_type, overrides) in CASES.items():
        ckpt = make_tiny_checkpoint(model_type, tmp_path_factory.mktemp(name), seed=len(cases), **overrides)
        cases.append(VerifyCase(ckpt, GOLDEN / f"{model_type}.py"))
    return dict(zip(CASES, verify_many(cases)))


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_golden_matches_hf_and_vllm_native(reports, case):
    report = reports[case]
    assert report.native_tokens is not None, "vLLM has a native implementation for these types"
    assert report.generated_tokens == report.hf_tokens, report.summary()
    assert report.generated_tokens == report.native_tokens, report.summary()
    assert report.logprob_diff_native is not None and report.logprob_diff_native <= LOGPROB_TOL, (
        report.summary()
    )
    assert report.logprob_diff_hf is not None and report.logprob_diff_hf <= LOGPROB_TOL, report.summary()
    assert report.ok, report.summary()


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_golden_structure_is_fused(reports, case):
    structure = reports[case].generated_structure
    assert structure, reports[case].summary()
    for layer in structure:
        assert {k: layer.get(k, 0) for k in EXPECTED_LAYER} == EXPECTED_LAYER, layer
    assert reports[case].structure_matches_native, reports[case].summary()
