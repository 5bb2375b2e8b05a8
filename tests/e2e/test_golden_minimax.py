"""The MiniMax golden, proved in real vLLM: its lightning-attention layers run as vLLM's
``MiniMaxText01LinearAttention`` (the file's ``TorchMiniMaxLinearAttention``: the recurrence
in torch on vLLM's CPU build, float32) with its state cache, beside softmax-attention layers
under the same child (``self_attn``), each layer's forward choosing the call by that child's
class; MoE blocks in every layer. vLLM 0.32 has no MiniMax file of its own (its registry lists
MiniMaxText01ForCausalLM as removed in 0.23).

Tiny float32 checkpoints saved by transformers (their decay tables included), lightning
attention first and softmax attention first: greedy tokens equal Hugging Face's and
chosen-token logprobs within 1e-4, across 16 decode steps and with long prompts prefilled in
chunks; the seeds are ones whose transformers float32 logprobs stay within 2e-5 of float64
(on tiny random MoE checkpoints they can part by 2e-3, routings near a tie). The file refuses
at load a config without ``head_dim`` (vLLM's class reads it) or with a head count that is
not a power of two (vLLM's decay rates are then not transformers').
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hfrewrite.verify.compare import VerifyCase, verify_many
from hfrewrite.verify.fixtures import make_tiny_checkpoint
from tests.e2e.golden_checks import assert_chunked_prefills_equal_hf, assert_equals_hf

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "minimax.py"
SIZES = {
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_local_experts": 4,
    "vocab_size": 512,
}
LINEAR, FULL = "linear_attention", "full_attention"
# name -> (layer kinds, seed)
CASES: dict[str, tuple[list[str], int]] = {
    "lightning-first": ([LINEAR, FULL, LINEAR], 0),
    "attention-first": ([FULL, LINEAR, LINEAR], 2),
}


def _ckpt(out: Path, kinds: list[str], seed: int, **overrides) -> Path:
    sizes = {**SIZES, **overrides}
    return make_tiny_checkpoint(
        "minimax", out, seed=seed, num_hidden_layers=len(kinds), layer_types=kinds, **sizes
    )


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cases = [
        VerifyCase(_ckpt(tmp_path_factory.mktemp(name), kinds, seed), GOLDEN)
        for name, (kinds, seed) in CASES.items()
    ]
    return dict(zip(CASES, verify_many(cases, native=False)))


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_minimax_golden_matches_hf(reports, case):
    assert_equals_hf(reports[case])


@pytest.mark.vllm
def test_minimax_layers_are_vllms(reports):
    """A lightning-attention layer: its q, k, v projection and its gate column-parallel, its
    output row-parallel; a softmax-attention layer: QKV-fused; both with vLLM's fused MoE."""
    structure = reports["lightning-first"].generated_structure
    assert structure, reports["lightning-first"].summary()
    counted = [{kind: n for kind, n in layer.items() if n} for layer in structure]
    moe = {"MoERunner": 1, "GateLinear": 1}
    assert counted[0] == {"ColumnParallelLinear": 2, "RowParallelLinear": 1, **moe}
    assert counted[1] == {"QKVParallelLinear": 1, "RowParallelLinear": 1, **moe}


@pytest.mark.vllm
def test_chunked_prefills_resume_their_cached_states(reports):
    """Long prompts prefilled in chunks, each chunk resuming the state the last one cached,
    beside another sequence's decode steps."""
    assert_chunked_prefills_equal_hf(reports["lightning-first"])


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"head_dim": None}, 'this file needs getattr(config, "head_dim", None) is not None'),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 6, "head_dim": 16, "hidden_size": 96},
            'bin(config.num_attention_heads).count("1") == 1',
        ),
    ],
)
def test_configs_the_file_was_not_proven_for_are_refused_at_load(tmp_path, changes, message):
    ckpt = _ckpt(tmp_path / "refused", [LINEAR, FULL], 5)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(changes)
    (ckpt / "config.json").write_text(json.dumps(config))
    (report,) = verify_many([VerifyCase(ckpt, GOLDEN)], native=False)
    assert report.generated_tokens is None, report.summary()
    assert message in report.errors.get("generated", ""), report.summary()
