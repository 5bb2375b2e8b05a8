"""The OLMo-hybrid golden, proved in real vLLM: its gated delta nets run as vLLM's
``OlmoHybridGatedDeltaNetAttention`` (the file's ``TorchOlmoGatedDeltaNet``: the delta rule in
torch on vLLM's CPU build, float32) with its convolution and recurrent states, between
post-norm attention layers of another class.

Tiny float32 checkpoints saved by transformers, in the released order (three gated delta nets,
then attention) and with attention first; two key heads shared by four value heads, keys and
values of different widths, so the three convolutions transformers writes (split evenly, not
by q, k, v) must be concatenated and split again at load: greedy tokens equal Hugging Face's
and chosen-token logprobs within 1e-4, across 16 decode steps (the cached states read back),
and with long prompts prefilled in chunks beside other sequences' decode steps,
beta doubled (``linear_allow_neg_eigval``) or not. The golden is converted from a config
without rope, as transformers notes the released checkpoints are (golden/configs/olmo_hybrid);
a checkpoint with rope, which it was not converted for, is refused by the file at load.

vLLM 0.32's own ``olmo_hybrid.py`` is not compared: its gating and delta-rule kernels are
triton only, and it loads neither the norms' checkpoint names (``attention_layer_norm``) nor
the convolutions (its loader takes the shard id as an argument AutoWeightsLoader does not pass).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hfrewrite.verify.compare import LOGPROB_TOL, VerifyCase, verify_many
from hfrewrite.verify.fixtures import make_tiny_checkpoint
from tests.e2e.golden_checks import assert_chunked_prefills_equal_hf

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "olmo_hybrid.py"
SIZES = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 48,
    "vocab_size": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": None},  # as released
}
LINEAR, FULL = "linear_attention", "full_attention"
CASES: dict[str, tuple[list[str], dict]] = {
    "released-order": ([LINEAR, LINEAR, LINEAR, FULL], {}),
    "attention-first-beta-not-doubled": ([FULL, LINEAR, FULL], {"linear_allow_neg_eigval": False}),
}


def _ckpt(out: Path, kinds: list[str], seed: int, **overrides) -> Path:
    return make_tiny_checkpoint(
        "olmo_hybrid", out, seed=seed, num_hidden_layers=len(kinds), layer_types=kinds, **SIZES, **overrides
    )


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cases = [
        VerifyCase(_ckpt(tmp_path_factory.mktemp(name), kinds, i, **extra), GOLDEN)
        for i, (name, (kinds, extra)) in enumerate(CASES.items())
    ]
    return dict(zip(CASES, verify_many(cases, native=False)))


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_olmo_hybrid_golden_matches_hf(reports, case):
    report = reports[case]
    assert report.hf_tokens and len(set(report.hf_tokens[3])) > 4, "greedy decoding degenerated into repeats"
    assert report.generated_tokens == report.hf_tokens, report.summary()
    assert report.logprob_diff_hf is not None and report.logprob_diff_hf <= LOGPROB_TOL, report.summary()
    assert report.generated_class.startswith("hfrewrite_generated_"), report.summary()


@pytest.mark.vllm
def test_olmo_hybrid_layers_are_vllms(reports):
    """Layer 0, a gated delta net: q, k, v and g merged into one column-parallel projection,
    b and a column-parallel apart, conv1d column-parallel, o_proj row-parallel; the MLP's
    merged gate/up and row-parallel down."""
    structure = reports["released-order"].generated_structure
    assert structure, reports["released-order"].summary()
    counted = {kind: n for kind, n in structure[0].items() if n}
    assert counted == {"MergedColumnParallelLinear": 2, "ColumnParallelLinear": 3, "RowParallelLinear": 2}


@pytest.mark.vllm
def test_chunked_prefills_resume_their_cached_states(reports):
    """Long prompts prefilled in chunks, each chunk resuming the convolution and recurrent
    states the last one cached, beside another sequence's decode steps."""
    assert_chunked_prefills_equal_hf(reports["released-order"])


@pytest.mark.vllm
def test_a_checkpoint_with_rope_is_refused_by_the_file(tmp_path):
    ckpt = _ckpt(tmp_path / "rope", [LINEAR, FULL], 7)
    config = json.loads((ckpt / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (ckpt / "config.json").write_text(json.dumps(config))
    (report,) = verify_many([VerifyCase(ckpt, GOLDEN)], native=False)
    assert report.generated_tokens is None, report.summary()
    assert "config.rope_parameters.get('rope_theta') is not None` is False" in report.errors.get(
        "generated", ""
    ), report.summary()
