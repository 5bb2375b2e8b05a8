"""The goldens of latent attention under a type vLLM 0.32 gives no latent cache (minicpm3 with
LongRoPE, youtu), proved in real vLLM against Hugging Face, and against vLLM's own minicpm3.py.

Each file expands the latent into k and v per head and runs vLLM's ``Attention`` with v padded
to the q/k head size (here 32 + 32 = 64 wide heads, v 48 wide, so the padding and the cut
matter). Greedy tokens equal Hugging Face's, chosen-token logprobs within 1e-4; each layer
keeps vLLM's MLA projections (fused q_a/kv_a, q_b and kv_b column-parallel, o row-parallel).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hfrewrite.verify.compare import LOGPROB_TOL, VerifyCase, verify_many
from hfrewrite.verify.fixtures import make_tiny_checkpoint

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
PER_HEAD_MLA = {
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 32,
    "head_dim": 32,
    "qk_nope_head_dim": 32,
    "v_head_dim": 48,
    "q_lora_rank": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}
CASES: dict[str, tuple[str, dict]] = {
    # LongRoPE as the released checkpoints set it (the golden is converted from that shape),
    # scaled embeddings (scale_emb), residual branches scaled by scale_depth / sqrt(layers),
    # the lm_head's input divided by hidden_size / dim_model_base in the forward
    "minicpm3-per-head-mla": (
        "minicpm3",
        {
            **PER_HEAD_MLA,
            "scale_emb": 4.0,
            "scale_depth": 1.4,
            "dim_model_base": 32,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "factor": 1.0,
                "original_max_position_embeddings": 4096,
                "short_factor": [1.0 + 0.2 * i for i in range(16)],
                "long_factor": [1.0 + 2.0 * i for i in range(16)],
            },
        },
    ),
    # GPT-J style (interleaved) rope on the shared rope key
    "youtu-per-head-mla": ("youtu", {**PER_HEAD_MLA, "tie_word_embeddings": False}),
    # one q projection (no low-rank query): the file's other branch
    "youtu-no-low-rank-query": ("youtu", {**PER_HEAD_MLA, "q_lora_rank": None}),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cases = [
        VerifyCase(
            make_tiny_checkpoint(t, tmp_path_factory.mktemp(name), seed=i, **overrides),
            GOLDEN / f"{t}.py",
        )
        for i, (name, (t, overrides)) in enumerate(CASES.items())
    ]
    return dict(zip(CASES, verify_many(cases)))


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_per_head_mla_golden_matches_hf(reports, case):
    report = reports[case]
    assert report.generated_class.startswith("hfrewrite_generated_"), report.summary()
    assert report.generated_tokens == report.hf_tokens, report.summary()
    assert report.logprob_diff_hf is not None and report.logprob_diff_hf <= LOGPROB_TOL, report.summary()
    assert not report.problems, report.summary()


@pytest.mark.vllm
def test_minicpm3_golden_equals_vllms_own_file(reports):
    report = reports["minicpm3-per-head-mla"]
    assert report.native_tokens == report.hf_tokens == report.generated_tokens, report.summary()
    assert report.logprob_diff_native is not None and report.logprob_diff_native <= LOGPROB_TOL
    # vLLM's file keeps q_a and kv_a apart (two ReplicatedLinear); the golden fuses them into
    # one GEMM as vLLM's deepseek_v2.py does
    assert report.native_structure[0]["ReplicatedLinear"] == 2, report.summary()


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_per_head_mla_layers_keep_vllms_projections(reports, case):
    low_rank = CASES[case][1]["q_lora_rank"] is not None
    for layer in reports[case].generated_structure:
        assert layer["Linear"] == 0 and layer["QKVParallelLinear"] == 0, layer
        assert layer["RowParallelLinear"] == 2, layer  # o, the MLP's down
        # q_b (or q) and kv_b; fused q_a/kv_a and the MLP's gate/up, or kv_a alone
        assert layer["ColumnParallelLinear"] == 2, layer
        assert layer["MergedColumnParallelLinear"] == (2 if low_rank else 1), layer
        assert layer["ReplicatedLinear"] == (0 if low_rank else 1), layer
