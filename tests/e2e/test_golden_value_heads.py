"""The MiMo-V2-Flash golden, proved in real vLLM: v heads narrower than q's and k's (padded
for vLLM's one-head-size CPU attention and cut from its output), v times the config's value
scale, twice the kv heads and per-head sinks on the sliding layers only (the source's own
per-layer expressions), a dense first layer then DeepSeek-style sigmoid-routed experts.

Tiny float32 checkpoints: greedy tokens equal Hugging Face's, chosen-token logprobs within
1e-4. vLLM 0.32's own ``mimo_v2.py`` does not load these checkpoints: it reads the Hub
repository's config fields (``hybrid_layer_pattern``), which transformers 5.19's config does
not hold; and its source picks a FlashAttention or triton DiffKV backend for v heads of their
own size, neither of which runs on CPU. Hugging Face alone is the reference; the test notices
when vLLM's own loads them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hfrewrite.verify.compare import LOGPROB_TOL, VerifyCase, verify_many
from hfrewrite.verify.fixtures import make_tiny_checkpoint

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
ROPE = {"rope_type": "default", "partial_rotary_factor": 0.5}
MIMO = {
    "head_dim": 64,
    "v_head_dim": 32,
    "num_key_value_heads": 1,  # 2 on the sliding layers
    "sliding_window": 4,  # shorter than the prompts: the window is exercised
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "rope_parameters": {
        "full_attention": {**ROPE, "rope_theta": 5e6},
        "sliding_attention": {**ROPE, "rope_theta": 1e4},
    },
}
LAYERS = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
CASES: dict[str, dict] = {
    "mimo_v2_flash": {**MIMO, "attention_value_scale": 0.707},
    "mimo_v2_flash-no-value-scale": {**MIMO, "attention_value_scale": None},
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cases = [
        VerifyCase(
            make_tiny_checkpoint(
                "mimo_v2_flash",
                tmp_path_factory.mktemp(name),
                seed=i,
                num_hidden_layers=len(LAYERS),
                layer_types=LAYERS,
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                **overrides,
            ),
            GOLDEN / "mimo_v2_flash.py",
        )
        for i, (name, overrides) in enumerate(CASES.items())
    ]
    return dict(zip(CASES, verify_many(cases)))


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_mimo_v2_flash_golden_matches_hf(reports, case):
    report = reports[case]
    assert report.hf_tokens and len(set(report.hf_tokens[3])) > 4, "greedy decoding degenerated into repeats"
    assert report.generated_tokens == report.hf_tokens, report.summary()
    assert report.logprob_diff_hf is not None and report.logprob_diff_hf <= LOGPROB_TOL, report.summary()
    assert report.generated_class.startswith("hfrewrite_generated_"), report.summary()
    assert report.native_tokens is None, "vLLM's own mimo_v2.py now runs here: compare with it"
    assert any("hybrid_layer_pattern" in p for p in report.problems), report.summary()
    assert [p for p in report.problems if "native" not in p] == [], report.summary()


@pytest.mark.vllm
def test_mimo_v2_flash_layers_are_vllms(reports):
    """Each attention one QKVParallelLinear and one RowParallelLinear; the dense layer a merged
    gate/up and a row-parallel down projection; the others one fused-MoE runner."""
    structure = reports["mimo_v2_flash"].generated_structure
    assert structure, reports["mimo_v2_flash"].summary()
    for i, layer in enumerate(structure):
        assert layer["QKVParallelLinear"] == 1, layer
        assert layer["RowParallelLinear"] == (2 if i == 0 else 1), layer
        assert layer.get("MoERunner", 0) == (0 if i == 0 else 1), layer


def test_the_golden_pads_v_and_scales_it():
    """What the file computes around vLLM's attention, read off its source."""
    tree = ast.parse((GOLDEN / "mimo_v2_flash.py").read_text())
    attention = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MiMoV2FlashAttention")
    code = ast.unparse(attention)
    assert "v_head_size=self.v_head_size" in code
    assert "v = v * self.v_scale" in code
    assert "torch.nn.functional.pad(v.view(-1, self.num_kv_heads, self.v_head_size)" in code
    assert "[..., :self.v_head_size]" in code
    assert "if is_swa else None" in code  # sinks where the source builds them
