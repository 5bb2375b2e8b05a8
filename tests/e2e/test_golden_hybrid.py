"""The hybrid goldens, proved in real vLLM: LFM2 and LFM2-MoE, whose short-convolution layers
run as vLLM's ``ShortConv`` with its convolution state cache between their attention layers,
and Bamba, whose Mamba-2 layers run as vLLM's ``MambaMixer2`` with its convolution and
recurrent states.

Tiny float32 checkpoints with mixer and attention layers in the released order (mixer first)
and one with attention first: greedy tokens equal Hugging Face's, chosen-token logprobs within
1e-4, across decode steps (so the cached states are read back). Every linear of every layer is
one of vLLM's parallel layers, as many per layer as vLLM's own ``lfm2.py`` (Bamba: as its
``granitemoehybrid.py`` builds a Mamba-2 layer; vLLM has no Bamba file of its own).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hfrewrite.verify.compare import LOGPROB_TOL, VerifyCase, verify_many
from hfrewrite.verify.fixtures import make_tiny_checkpoint

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
# conv_dim and block_dim: the Hub config's fields that vLLM's own lfm2.py reads
LFM2 = {"conv_dim": 128, "block_dim": 128, "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0}
# LFM2-MoE: one dense layer, then MoE; sigmoid routing with a (random) expert bias for the choice
LFM2_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "num_dense_layers": 1}
# Bamba: four Mamba-2 heads of 64 channels, a 16-wide state; its attention layers are listed
# by index (attn_layer_indices), its kinds computed from them
BAMBA = {"mamba_n_heads": 4, "mamba_d_head": 64, "mamba_d_state": 16, "mamba_chunk_size": 4}
# Granite-4.0-H: no rope, muP multipliers on embeddings, residuals, attention and logits, a MoE
# block beside a shared MLP (or the shared MLP alone: no experts)
GRANITE_H = {
    **BAMBA,
    "position_embedding_type": "nope",
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 64,
    "shared_intermediate_size": 96,
    "embedding_multiplier": 2.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.05,
    "logits_scaling": 2.0,
}
CASES: dict[str, tuple[str, list[str], dict]] = {
    "lfm2-conv-first": ("lfm2", ["conv", "conv", "full_attention", "conv"], LFM2),
    "lfm2-attention-first": ("lfm2", ["full_attention", "conv", "full_attention"], LFM2),
    "lfm2_moe-conv-first-dense-first": (
        "lfm2_moe",
        ["conv", "full_attention", "conv", "full_attention"],
        LFM2_MOE,
    ),
    "bamba-mamba-first": (
        "bamba",
        ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        BAMBA,
    ),
    "bamba-attention-first": ("bamba", ["full_attention", "linear_attention", "full_attention"], BAMBA),
    "granitemoehybrid-moe": (
        "granitemoehybrid",
        ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        GRANITE_H,
    ),
    "granitemoehybrid-dense": (
        "granitemoehybrid",
        ["linear_attention", "full_attention", "linear_attention"],
        {**GRANITE_H, "num_local_experts": 0},
    ),
}
MIXERS = {
    "conv": {"MergedColumnParallelLinear": 1, "ColumnParallelLinear": 1, "RowParallelLinear": 1},  # ShortConv
    "linear_attention": {"MergedColumnParallelLinear": 2, "RowParallelLinear": 1},  # MambaMixer2
}


def _mlp_layers(model_type: str, overrides: dict, i: int, layers: int) -> dict[str, int]:
    """The parallel layers of layer ``i``'s MLP: a dense gated MLP, or the fused MoE and its
    router; Granite-4.0-H's shared MLP beside its MoE, or alone without experts."""
    dense = {"MergedColumnParallelLinear": 1, "RowParallelLinear": 1}
    moe = {"MoERunner": 1, "GateLinear": 1}
    if model_type == "granitemoehybrid":
        return {**dense, **moe} if overrides["num_local_experts"] else dense
    return dense if i < overrides.get("num_dense_layers", layers) else moe  # LFM2's: all dense


def _kinds(model_type: str, kinds: list[str]) -> dict:
    """The config fields giving the layers ``kinds``: Bamba lists its attention layers."""
    if model_type == "bamba":
        return {"attn_layer_indices": [i for i, kind in enumerate(kinds) if kind == "full_attention"]}
    return {"layer_types": kinds}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cases = [
        VerifyCase(
            make_tiny_checkpoint(
                model_type,
                tmp_path_factory.mktemp(name),
                seed=i,
                num_hidden_layers=len(kinds),
                **_kinds(model_type, kinds),
                **overrides,
            ),
            GOLDEN / f"{model_type}.py",
        )
        for i, (name, (model_type, kinds, overrides)) in enumerate(CASES.items())
    ]
    return dict(zip(CASES, verify_many(cases)))


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_golden_matches_hf(reports, case):
    report = reports[case]
    assert report.hf_tokens and len(set(report.hf_tokens[3])) > 4, "greedy decoding degenerated into repeats"
    assert report.generated_tokens == report.hf_tokens, report.summary()
    assert report.logprob_diff_hf is not None and report.logprob_diff_hf <= LOGPROB_TOL, report.summary()
    assert report.generated_class.startswith("hfrewrite_generated_"), report.summary()
    model_type = CASES[case][0]
    if model_type == "bamba":  # vLLM 0.32 has no Bamba file: Hugging Face alone is the reference
        assert report.native_tokens is None and report.problems == (), report.summary()
        return
    if model_type == "granitemoehybrid":  # vLLM's own granitemoehybrid.py: the file equals it too
        assert report.native_tokens == report.hf_tokens == report.generated_tokens, report.summary()
        assert report.logprob_diff_native <= LOGPROB_TOL and report.problems == (), report.summary()
        return
    # vLLM 0.32's own lfm2.py does not match transformers 5.19 here, with attention layers only
    # too (tokens apart within the first steps): Hugging Face is the reference; the test
    # notices when vLLM changes
    differs = report.native_tokens != report.hf_tokens or report.logprob_diff_native > LOGPROB_TOL
    assert differs, "vLLM native now matches HF: compare the generated file with it"
    assert [p for p in report.problems if "native" not in p] == [], report.summary()


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_layers_are_vllms(reports, case):
    """Attention layers hold a QKVParallelLinear; short-convolution layers ShortConv's
    ColumnParallelLinear convolution and merged input projection; Mamba-2 layers
    MambaMixer2's merged input projection and convolution; no plain nn.Linear."""
    report = reports[case]
    structure, native = report.generated_structure, report.native_structure
    assert structure and (native or CASES[case][0] == "bamba"), report.summary()
    model_type, kinds, overrides = CASES[case]
    for i, (kind, layer) in enumerate(zip(kinds, structure)):
        counted = {name: n for name, n in layer.items() if n}
        mixer = MIXERS.get(kind, {"QKVParallelLinear": 1, "RowParallelLinear": 1})
        mlp = _mlp_layers(model_type, overrides, i, len(kinds))
        assert counted == {k: mixer.get(k, 0) + mlp.get(k, 0) for k in {*mixer, *mlp}}, layer
    if native:
        assert [sum(layer.values()) for layer in structure] == [sum(layer.values()) for layer in native]


@pytest.mark.vllm
def test_bamba_with_two_groups_is_refused_by_the_file(tmp_path):
    """The golden was proven with one Mamba-2 group, where Bamba's norm over all channels and
    vLLM's norm over each group's agree; a two-group checkpoint is refused when vLLM builds
    the model, never run with another norm."""
    kinds = ["linear_attention", "full_attention"]
    ckpt = make_tiny_checkpoint(
        "bamba",
        tmp_path / "two-groups",
        num_hidden_layers=2,
        mamba_n_groups=2,
        **BAMBA,
        **_kinds("bamba", kinds),
    )
    (report,) = verify_many([VerifyCase(ckpt, GOLDEN / "bamba.py")])
    assert report.generated_tokens is None, report.summary()
    assert "this file needs config.mamba_n_groups == 1" in report.errors.get("generated", ""), (
        report.summary()
    )


@pytest.mark.vllm
def test_granite_4_h_with_rope_is_refused_by_the_file(tmp_path):
    """The golden's base model was traced without its rotary embedding (``Rotary(config) if
    config.position_embedding_type == "rope" else None``): a rope checkpoint is refused when
    vLLM builds the model, never run without its rope."""
    kinds = ["linear_attention", "full_attention"]
    config = {**GRANITE_H, "position_embedding_type": "rope"}
    ckpt = make_tiny_checkpoint(
        "granitemoehybrid", tmp_path / "rope", num_hidden_layers=2, layer_types=kinds, **config
    )
    (report,) = verify_many([VerifyCase(ckpt, GOLDEN / "granitemoehybrid.py")])
    assert report.generated_tokens is None, report.summary()
    assert "`config.position_embedding_type == 'rope'` is False" in report.errors.get("generated", ""), (
        report.summary()
    )
