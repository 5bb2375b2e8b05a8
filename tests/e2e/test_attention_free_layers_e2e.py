"""Checkpoints whose hybrid layers are all Mamba-2 (Bamba's and Granite-4.0-H's default
configs: no attention layer), proved in real vLLM.

The layer's forward chooses its mixer by a config test that holds on every traced layer: the
converted file calls vLLM's ``MambaMixer2`` alone under vLLM's attention-free contract and
refuses, when vLLM builds it, a checkpoint with an attention layer (the branch no traced layer
ran). vLLM lists no Mamba config hook for these architectures; the harness registers the one
the plugin registers. Hugging Face cannot ``generate`` with such a cache (it tracks no length
without an attention layer): its reference tokens come from full recomputes. Tiny float32
checkpoints: greedy tokens equal Hugging Face's, chosen-token logprobs within 1e-4.
"""

from __future__ import annotations

import pytest
from golden_checks import assert_equals_hf

from hfrewrite.cli import main
from hfrewrite.verify.compare import VerifyCase, verify_many
from hfrewrite.verify.fixtures import make_tiny_checkpoint

MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 64, "mamba_d_state": 16, "mamba_chunk_size": 4}
CASES = {
    "bamba": ({"attn_layer_indices": []}, {"attn_layer_indices": [1]}),
    "granitemoehybrid": (
        {"layer_types": ["mamba"] * 3, "position_embedding_type": "nope", "num_local_experts": 0},
        {
            "layer_types": ["mamba", "attention", "mamba"],
            "position_embedding_type": "nope",
            "num_local_experts": 0,
        },
    ),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("attention-free")
    sources, cases = {}, []
    for i, (model_type, (mamba_only, with_attention)) in enumerate(CASES.items()):
        ckpt = make_tiny_checkpoint(
            model_type, root / model_type, seed=i, num_hidden_layers=3, **MAMBA, **mamba_only
        )
        out = root / f"{model_type}-out"
        assert main(["convert", str(ckpt), "-o", str(out), "--no-verify"]) == 0
        path = out / f"{model_type}.py"
        sources[model_type] = path.read_text()
        attends = make_tiny_checkpoint(
            model_type, root / f"{model_type}-attends", num_hidden_layers=3, **MAMBA, **with_attention
        )
        cases += [VerifyCase(ckpt, path), VerifyCase(attends, path)]
    reports = verify_many(cases)
    return sources, {t: reports[2 * i : 2 * i + 2] for i, t in enumerate(CASES)}


@pytest.mark.vllm
@pytest.mark.parametrize("model_type", list(CASES))
def test_the_mamba_only_file_equals_hugging_face(converted, model_type):
    sources, reports = converted
    source = sources[model_type]
    assert "IsAttentionFree" in source and "self.mamba = MambaMixer2(" in source
    assert "self_attn" not in source  # no attention is built: the branch no layer ran is gone
    assert_equals_hf(reports[model_type][0])


@pytest.mark.vllm
@pytest.mark.parametrize("model_type", list(CASES))
def test_a_checkpoint_with_an_attention_layer_is_refused_by_the_file(converted, model_type):
    report = converted[1][model_type][1]
    assert report.generated_tokens is None, report.summary()
    assert "was converted for configs where" in report.errors.get("generated", ""), report.summary()
