"""Granite-4.0 checkpoints whose ``granitemoehybrid`` layers all attend (granite-4.0-micro:
rope, a dense MLP; and the same with experts), proved in real vLLM.

No traced layer runs the Mamba branch of the layer's forward, which reads the cache and
``**kwargs`` vLLM does not give: the converted layer keeps the attention branch, builds no
Mamba block, and refuses (when vLLM builds it) a checkpoint with a Mamba layer, never running
it as an attention layer. Tiny float32 checkpoints, released layer spelling (``"attention"``):
greedy tokens equal Hugging Face's and vLLM's own ``granitemoehybrid.py``'s, chosen-token
logprobs within 1e-4.
"""

from __future__ import annotations

import pytest
from golden_checks import assert_equals_hf, assert_native

from hfrewrite.cli import main
from hfrewrite.verify.compare import VerifyCase, verify_many
from hfrewrite.verify.fixtures import make_tiny_checkpoint

# granite-4.0-micro's switches: rope, muP multipliers, a shared MLP and no experts
MICRO = {
    "position_embedding_type": "rope",
    "num_local_experts": 0,
    "intermediate_size": 64,
    "shared_intermediate_size": 96,
    "embedding_multiplier": 2.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.05,
    "logits_scaling": 2.0,
    "mamba_n_heads": 4,
    "mamba_d_head": 64,
    "mamba_d_state": 16,
}
CASES = {"dense": MICRO, "experts": {**MICRO, "num_local_experts": 4, "num_experts_per_tok": 2}}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("granite4")
    out = {}
    for i, (name, overrides) in enumerate(CASES.items()):
        ckpt = make_tiny_checkpoint(
            "granitemoehybrid",
            root / name,
            seed=i,
            num_hidden_layers=3,
            layer_types=["attention"] * 3,
            **overrides,
        )
        assert main(["convert", str(ckpt), "-o", str(root / f"{name}-out"), "--no-verify"]) == 0
        out[name] = (ckpt, root / f"{name}-out" / "granitemoehybrid.py")
    mamba = make_tiny_checkpoint(
        "granitemoehybrid", root / "mamba", num_hidden_layers=2, layer_types=["attention", "mamba"], **MICRO
    )
    cases = [VerifyCase(ckpt, path) for ckpt, path in out.values()] + [VerifyCase(mamba, out["dense"][1])]
    reports = verify_many(cases)
    return out, dict(zip([*CASES, "mamba layer"], reports))


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_the_file_equals_hf_and_vllms_own(converted, case):
    files, reports = converted
    source = files[case][1].read_text()
    assert "Mamba" not in source and "self.mamba(" not in source  # no Mamba block is built
    report = reports[case]
    assert_equals_hf(report)
    assert_native(report, equal=True, differs_because="")


@pytest.mark.vllm
def test_a_checkpoint_with_a_mamba_layer_is_refused_by_the_file(converted):
    report = converted[1]["mamba layer"]
    assert report.generated_tokens is None, report.summary()
    assert "`config.layers_block_type[layer_idx] == 'linear_attention'` is False" in report.errors.get(
        "generated", ""
    ), report.summary()
