"""The MLA goldens (deepseek_v2, deepseek_v3, axk1), proved in real vLLM against Hugging Face.

Tiny float32 checkpoints with the latent sizes vLLM's CPU MLA backend caches (kv_lora_rank
512 + rope 64), 4 heads, a low-rank query, MoE from the second layer. Greedy tokens equal
Hugging Face's, chosen-token logprobs within 1e-4; each layer is vLLM's MLA layout (one
fused q_a/kv_a GEMM, q_b and kv_b column-parallel, o row-parallel), with vLLM's structure.

vLLM 0.32's own deepseek_v2.py (and AXK1.py, built on it) computes a wrong prefill on CPU: its MLA wrapper hands the
CPU rotary kernel 3-D strided views of q and k_pe, which the kernel misreads (only head 0
of q turns, k_pe for tokens after the first does not). Native tokens differ from Hugging
Face's from the first step; the test asserts that, so it notices when vLLM fixes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hfrewrite import convert
from hfrewrite.resolve import resolve
from hfrewrite.verify.compare import LOGPROB_TOL, VerifyCase, verify_many
from hfrewrite.verify.fixtures import make_tiny_checkpoint

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
MLA = {
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 48,
    "q_lora_rank": 64,
    "num_key_value_heads": 4,
    "first_k_dense_replace": 1,
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_shared_experts": 1,
}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
CASES: dict[str, tuple[str, dict]] = {
    # grouped sigmoid routing with a (random) correction bias, renormalised and scaled
    # (the checkpoint also holds a multi-token-prediction layer past the last layer)
    "deepseek_v3": (
        "deepseek_v3",
        {
            **MLA,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "topk_method": "noaux_tc",
            "num_nextn_predict_layers": 1,
        },
    ),
    # softmax top-k ("greedy"), scaled, not renormalised; one expert group as DeepSeek-V2-Lite
    # sets it (vLLM's own file asserts on n_group None at the first forward)
    "deepseek_v2": (
        "deepseek_v2",
        {
            **MLA,
            "topk_method": "greedy",
            "routed_scaling_factor": 2.0,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    # YaRN as the real DeepSeek checkpoints set it (with unequal mscale factors, so the ratio
    # on cos/sin and the mscale_all_dim softmax scale both matter): converted from this
    # checkpoint's own config, as a user converts theirs, and run as vLLM's deepseek_yarn
    "deepseek_v3-yarn": (
        "deepseek_v3",
        {
            **MLA,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "topk_method": "noaux_tc",
            "max_position_embeddings": 16384,
            "rope_parameters": YARN,
        },
    ),
    # A.X-K1: DeepSeek-V3 with an RMS norm on the MoE block's output, inside the block
    # (`mlp.post_mlp_layernorm`; its checkpoints keep it at the layer, `post_mlp_layernorm`)
    "axk1": (
        "axk1",
        {**MLA, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
    ),
}
CONVERTED = {"deepseek_v3-yarn"}
# vLLM's own AXK1.py builds `post_mlp_layernorm` in every layer, the dense ones too, where
# Hugging Face's model (and so its checkpoints) has none: it refuses to load them
NATIVE_FAILS = {
    "axk1": "weights were not initialized from checkpoint: {'model.layers.0.post_mlp_layernorm"
}  # converted at test time from the checkpoint, not the golden


def add_mtp_layer(ckpt: Path, layers: int) -> None:
    """Append a multi-token-prediction layer as DeepSeek-V3's Hub checkpoints store it: a
    decoder layer numbered past the last one, plus its projection, norms and head
    (`num_nextn_predict_layers` is 1 in the config). Hugging Face ignores it on load."""
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    last = f"model.layers.{layers - 1}."
    extra = {
        f"model.layers.{layers}." + k[len(last) :]: v.clone()
        for k, v in tensors.items()
        if k.startswith(last)
    }
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    extra.update(
        {
            f"model.layers.{layers}.{name}": tensor
            for name, tensor in (
                ("eh_proj.weight", torch.randn(hidden, 2 * hidden)),
                ("enorm.weight", torch.ones(hidden)),
                ("hnorm.weight", torch.ones(hidden)),
                ("shared_head.norm.weight", torch.ones(hidden)),
                (
                    "shared_head.head.weight",
                    tensors["model.embed_tokens.weight"].clone(),
                ),
            )
        }
    )
    save_file({**tensors, **extra}, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cases = []
    for i, (name, (t, overrides)) in enumerate(CASES.items()):
        ckpt = make_tiny_checkpoint(t, tmp_path_factory.mktemp(name), seed=i, **overrides)
        if name == "deepseek_v3":  # the generated load_weights skips it, as vLLM's own file does
            add_mtp_layer(
                ckpt,
                json.loads((ckpt / "config.json").read_text())["num_hidden_layers"],
            )
        module = GOLDEN / f"{t}.py"
        if name in CONVERTED:
            module = ckpt.parent / "generated.py"
            module.write_text(convert.generate(resolve(str(ckpt))).text)
        cases.append(VerifyCase(ckpt, module))
    return dict(zip(CASES, verify_many(cases)))


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_mla_golden_matches_hf(reports, case):
    report = reports[case]
    assert report.generated_class.startswith("hfrewrite_generated_"), report.summary()
    assert report.generated_tokens == report.hf_tokens, report.summary()
    assert report.logprob_diff_hf is not None and report.logprob_diff_hf <= LOGPROB_TOL, report.summary()
    if case in NATIVE_FAILS:
        assert report.native_tokens is None, "vLLM's own file now loads: compare with it"
        assert any(NATIVE_FAILS[case] in p for p in report.problems), report.summary()
        return
    assert report.native_tokens is not None, report.summary()
    assert report.native_tokens != report.hf_tokens, "vLLM native MLA now matches on CPU: compare with it"
    assert [p for p in report.problems if "native" not in p] == [], report.summary()


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_mla_layers_have_vllm_layout(reports, case):
    report = reports[case]
    assert case in NATIVE_FAILS or report.structure_matches_native, report.summary()
    for i, layer in enumerate(report.generated_structure):
        assert layer["Linear"] == 0 and layer["QKVParallelLinear"] == 0, layer
        # fused q_a/kv_a and the dense (layer 0) or shared expert's gate_up; q_b, kv_b; o, down
        assert layer["ColumnParallelLinear"] == 2, layer
        assert layer["MergedColumnParallelLinear"] == 2 and layer["RowParallelLinear"] == 2, layer
        assert layer["MoERunner"] == (0 if i == 0 else 1), layer
    assert report.generated_facts["num_moe_layers"] == len(report.generated_structure) - 1
