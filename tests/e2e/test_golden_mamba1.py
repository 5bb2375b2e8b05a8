"""The Mamba-1 goldens (Mamba's, FalconMamba's), proved in real vLLM: models of Mamba-1 layers
alone, served under vLLM's attention-free contract, each layer's selective scan vLLM's
``MambaMixer`` (FalconMamba's with its weightless norms of the time steps, B and C).

vLLM 0.32's CPU build cannot run vLLM's own ``MambaMixer``: it has no prefill scan kernel
(``selective_scan_fwd``). The files' ``TorchScanMambaMixer`` runs that scan in torch on CPU
and is vLLM's mixer elsewhere. Tiny float32 checkpoints: greedy tokens equal Hugging Face's,
chosen-token logprobs within 1e-4, across decode steps; vLLM's own ``mamba.py`` fails here
for the missing kernel (so this test fails when vLLM gains one, and the native comparison
becomes possible); and vLLM's own ``mamba.py`` with its mixer class swapped for the file's
decodes the file's tokens, so the rest of the model (norms, residuals, embeddings, head,
weight loading) is proven equal to vLLM's own. Prompts longer than vLLM's token budget per
step are prefilled in chunks, each resuming the states the last one cached, beside other
sequences' decode steps: still Hugging Face's tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hfrewrite.verify.compare import VerifyCase, verify_many
from hfrewrite.verify.fixtures import make_tiny_checkpoint
from tests.e2e.golden_checks import (
    assert_chunked_prefills_equal_hf,
    assert_equals_hf,
    assert_native_with_files_mixer,
)

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
CASES = {
    "mamba": ("mamba", {"state_size": 8}),
    "mamba-biases": ("mamba", {"state_size": 8, "use_bias": True, "conv_kernel": 3}),
    "falcon_mamba": ("falcon_mamba", {"state_size": 8, "mixer_rms_eps": 1e-3}),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cases = [
        VerifyCase(
            make_tiny_checkpoint(model_type, tmp_path_factory.mktemp(name), seed=i, **overrides),
            GOLDEN / f"{model_type}.py",
        )
        for i, (name, (model_type, overrides)) in enumerate(CASES.items())
    ]
    return dict(zip(CASES, verify_many(cases)))


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_mamba1_golden_matches_hf(reports, case):
    assert_equals_hf(reports[case])


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_vllms_own_mamba_cannot_run_on_this_cpu_build(reports, case):
    report = reports[case]
    assert report.native_tokens is None, "vLLM's own mamba.py runs here now: compare it with the file"
    assert "selective_scan_fwd" in report.errors.get("native", ""), report.errors


@pytest.mark.vllm
@pytest.mark.parametrize("case", ["mamba", "falcon_mamba"])
def test_vllms_own_mamba_with_the_files_mixer_decodes_the_files_tokens(reports, case):
    # (vLLM runs FalconMamba's architecture as its MambaForCausalLM too)
    assert_native_with_files_mixer(
        reports[case], "vllm.model_executor.models.mamba", "vllm.model_executor.models.mamba.MambaForCausalLM"
    )


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_mamba1_layers_are_vllms(reports, case):
    """Each layer is vLLM's Mamba-1 mixer: its merged input projection, column-parallel
    convolution and time-step projection, row-parallel x_proj and output."""
    for layer in reports[case].generated_structure:
        assert {name: n for name, n in layer.items() if n} == {
            "MergedColumnParallelLinear": 1,
            "ColumnParallelLinear": 2,
            "RowParallelLinear": 2,
        }


@pytest.mark.vllm
def test_chunked_prefills_resume_their_cached_states(reports):
    """Long prompts prefilled in chunks, each chunk resuming the convolution and recurrent
    states the last one cached, beside another sequence's decode steps."""
    assert_chunked_prefills_equal_hf(reports["mamba"])
