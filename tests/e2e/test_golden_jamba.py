"""The Jamba golden, proved in real vLLM: decoder layers of two classes (attention layers
and Mamba-1 layers, chosen per layer by the base model), each with a dense MLP or a MoE
block (a router that is the block's own ``nn.Linear`` beside stacked experts, softmax
top-k without renormalisation), no rope.

vLLM 0.32's own ``jamba.py`` runs vLLM's ``MambaMixer``, which its CPU build cannot run
(no ``selective_scan_fwd``): the test checks that it fails for that reason, so it notices
when vLLM gains the kernel. vLLM's own ``jamba.py`` with that mixer swapped for the file's
decodes the file's tokens, so all else (attention, MoE, norms, weight loading) is proven
equal to vLLM's own implementation. Tiny float32 checkpoints; greedy tokens equal Hugging
Face's, chosen-token logprobs within 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hfrewrite.verify.compare import VerifyCase, verify_many
from hfrewrite.verify.fixtures import make_tiny_checkpoint
from tests.e2e.golden_checks import assert_equals_hf, assert_native_with_files_mixer

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "jamba.py"
# four layers: Mamba and attention in turn, MoE blocks in every other layer
_LAYERS = {"num_hidden_layers": 4, "attn_layer_period": 2, "expert_layer_period": 2, "mamba_d_state": 8}
CASES = {
    # Mamba + MoE, attention + MLP
    "jamba": {**_LAYERS, "attn_layer_offset": 1, "expert_layer_offset": 0},
    # attention + MoE, Mamba + MLP; the projections' biases, no convolution bias
    "jamba-biases": {
        **_LAYERS,
        "attn_layer_offset": 0,
        "expert_layer_offset": 0,
        "mamba_proj_bias": True,
        "mamba_conv_bias": False,
    },
    # the head tied to the embeddings (vLLM's own jamba.py does not tie them: not compared there)
    "jamba-tied": {**_LAYERS, "attn_layer_offset": 1, "expert_layer_offset": 1, "tie_word_embeddings": True},
}
UNTIED = ["jamba", "jamba-biases"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cases = [
        VerifyCase(make_tiny_checkpoint("jamba", tmp_path_factory.mktemp(name), seed=i, **overrides), GOLDEN)
        for i, (name, overrides) in enumerate(CASES.items())
    ]
    return dict(zip(CASES, verify_many(cases)))


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_jamba_golden_matches_hf(reports, case):
    assert_equals_hf(reports[case])


@pytest.mark.vllm
def test_vllms_own_jamba_cannot_run_on_this_cpu_build(reports):
    report = reports["jamba"]
    assert report.native_tokens is None, "vLLM's own jamba.py runs here now: compare it with the file"
    assert "selective_scan_fwd" in report.errors.get("native", ""), report.errors


@pytest.mark.vllm
@pytest.mark.parametrize("case", UNTIED)
def test_vllms_own_jamba_with_the_files_mixer_decodes_the_files_tokens(reports, case):
    assert_native_with_files_mixer(
        reports[case], "vllm.model_executor.models.jamba", "vllm.model_executor.models.jamba.JambaForCausalLM"
    )


_ATTENTION = {"QKVParallelLinear": 1, "RowParallelLinear": 1}
_MAMBA = {"MergedColumnParallelLinear": 1, "ColumnParallelLinear": 2, "RowParallelLinear": 2}
_MOE = {"MoERunner": 1, "GateLinear": 1}
_MLP = {"MergedColumnParallelLinear": 1, "RowParallelLinear": 1}


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_jamba_layers_are_vllms(reports, case):
    """Each layer is its class's, in the order the config gives: vLLM's fused q/k/v attention
    or its Mamba-1 mixer, beside vLLM's fused MoE or its merged gated MLP."""
    overrides = CASES[case]
    structure = reports[case].generated_structure
    assert len(structure) == overrides["num_hidden_layers"]
    for i, layer in enumerate(structure):
        attends = i % overrides["attn_layer_period"] == overrides["attn_layer_offset"]
        sparse = i % overrides["expert_layer_period"] == overrides["expert_layer_offset"]
        expected: dict[str, int] = {}
        for part in (_ATTENTION if attends else _MAMBA, _MOE if sparse else _MLP):
            for name, n in part.items():
                expected[name] = expected.get(name, 0) + n
        assert {name: n for name, n in layer.items() if n} == expected, (i, layer)
