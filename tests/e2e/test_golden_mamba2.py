"""The Mamba-2 golden, proved in real vLLM: a model of Mamba-2 layers alone, served under
vLLM's attention-free contract (``IsAttentionFree``: no KV cache, each layer's convolution
and recurrent states cached), each layer one pre-norm block fused into vLLM's norms.

transformers' Mamba-2 normalises its gated output over all channels at once, however many
groups its B and C have; vLLM's ``MambaMixer2`` (and its own ``mamba2.py``) over each group's.
The file's ``SpanNormMambaMixer2`` keeps the source's norm. Tiny float32 checkpoints: greedy
tokens equal Hugging Face's, chosen-token logprobs within 1e-4, across decode steps. With one
group vLLM's own file decodes the same tokens; with two it does not (its norm is per group)
while the file still equals Hugging Face.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hfrewrite.verify.compare import VerifyCase, verify_many
from hfrewrite.verify.fixtures import make_tiny_checkpoint
from tests.e2e.golden_checks import assert_equals_hf, assert_native

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "mamba2.py"
SIZES = {
    "num_heads": 4,
    "head_dim": 64,
    "state_size": 16,
    "chunk_size": 4,
    "expand": 2,
    "num_hidden_layers": 3,
}
CASES = {"one-group": {"n_groups": 1}, "two-groups": {"n_groups": 2}}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cases = [
        VerifyCase(
            make_tiny_checkpoint("mamba2", tmp_path_factory.mktemp(name), seed=i, **SIZES, **overrides),
            GOLDEN,
        )
        for i, (name, overrides) in enumerate(CASES.items())
    ]
    return dict(zip(CASES, verify_many(cases)))


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_mamba2_golden_matches_hf(reports, case):
    report = reports[case]
    assert_equals_hf(report)
    assert_native(report, case == "one-group", "vLLM's mamba2.py normalises each group's channels")


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_mamba2_layers_are_vllms(reports, case):
    """Each layer is vLLM's Mamba-2 mixer (its merged input projection and convolution, its
    row-parallel output), as many parallel layers as vLLM's own file."""
    report = reports[case]
    structure, native = report.generated_structure, report.native_structure
    assert structure and native, report.summary()
    for layer in structure:
        assert {name: n for name, n in layer.items() if n} == {
            "MergedColumnParallelLinear": 2,
            "RowParallelLinear": 1,
        }
    assert [sum(layer.values()) for layer in structure] == [sum(layer.values()) for layer in native]
