"""The Qwen3.5 and Qwen3-Next goldens, proved in real vLLM: gated delta nets run as vLLM's
``QwenGatedDeltaNetAttention`` with its convolution and recurrent states, between attention
layers whose q projection packs each head's output gate beside it (Qwen3-Next: its q, k, v,
z and b, a interleaved per key head in two projections, vLLM's ``gqa_interleaved_layout``).

vLLM's CPU kernel of gated delta nets computes in bfloat16 alone, so each golden is proved
twice, as convert-time validation does (hfrewrite/verify/state_layers.py):

* a checkpoint with attention in every layer, no gated delta net built: in float32, greedy
  tokens equal Hugging Face's and chosen-token logprobs within 1e-4 (the attention with its
  packed gate, the zero-centred norms, the MLP or MoE with its gated shared expert, the head);
* checkpoints with gated delta nets in the released order (and one with attention first): in
  bfloat16, the first gated delta net's output within 5e-2 of Hugging Face's block run in
  float32 on the input vLLM's layer was given (measured 6.9e-03 to 9.0e-03; loading in_proj_b
  and in_proj_a swapped: 8.1e-01).

Against vLLM's own ``qwen3_next.py``, both in bfloat16 (the same kernels): tokens equal and
logprobs equal (measured 0.0), layer for layer the same parallel layers. vLLM 0.32's own
Qwen3.5 classes cannot be compared here: its qwen3_5.py imports the vision processor, which
needs torchvision (no wheel for this torch on the index).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hfrewrite.verify import engine
from hfrewrite.verify.compare import LOGPROB_TOL, VerifyCase, verify_many, verify_many_against_hf
from hfrewrite.verify.fixtures import DEFAULT_PROMPTS, make_tiny_checkpoint
from hfrewrite.verify.state_layers import STATE_LAYER_TOL, first_state_layer_difference

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
# vLLM's CPU kernel takes heads of 64 or more; two key heads shared by four value heads
GDN = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
}
MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
}
LINEAR, FULL = "linear_attention", "full_attention"
STATE_CASES: dict[str, tuple[str, list[str], dict]] = {
    "qwen3_5-released-order": ("qwen3_5_text", [LINEAR, LINEAR, LINEAR, FULL], GDN),
    "qwen3_5-attention-first": ("qwen3_5_text", [FULL, LINEAR, FULL], GDN),
    "qwen3_5_moe-released-order": ("qwen3_5_moe_text", [LINEAR, LINEAR, FULL], {**GDN, **MOE}),
    "qwen3_next-released-order": ("qwen3_next", [LINEAR, LINEAR, FULL], {**GDN, **MOE}),
}
FLOAT32_CASES: dict[str, tuple[str, dict]] = {
    "qwen3_5-attention-only": ("qwen3_5_text", GDN),
    "qwen3_5_moe-attention-only": ("qwen3_5_moe_text", {**GDN, **MOE}),
    "qwen3_next-attention-only": ("qwen3_next", {**GDN, **MOE}),
}


def _ckpt(tmp_path_factory, name: str, model_type: str, kinds: list[str], overrides: dict, seed: int) -> Path:
    ckpt = make_tiny_checkpoint(
        model_type,
        tmp_path_factory.mktemp(name),
        seed=seed,
        num_hidden_layers=len(kinds),
        layer_types=kinds,
        **overrides,
    )
    return _with_mtp_tensors(ckpt)


def _with_mtp_tensors(ckpt: Path) -> Path:
    """``ckpt`` holding multi-token-prediction tensors too, as every released Qwen3-Next and
    Qwen3.5 checkpoint does (``mtp.*``): transformers' causal LM ignores them, so must the file
    (before it did, loading failed on them)."""
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    width = tensors["model.embed_tokens.weight"].shape[1]
    tensors["mtp.fc.weight"] = torch.randn(width, 2 * width)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.ones(width)
    tensors["mtp.norm.weight"] = torch.ones(width)
    save_file(tensors, path, metadata={"format": "pt"})
    return ckpt


@pytest.fixture(scope="module")
def float32_reports(tmp_path_factory):
    cases = [
        VerifyCase(
            _ckpt(tmp_path_factory, name, model_type, [FULL, FULL], overrides, i),
            GOLDEN / f"{model_type}.py",
            engine_options=(("enable_prefix_caching", False),),
        )
        for i, (name, (model_type, overrides)) in enumerate(FLOAT32_CASES.items())
    ]
    return dict(zip(FLOAT32_CASES, verify_many(cases, native=False)))


@pytest.fixture(scope="module")
def state_reports(tmp_path_factory):
    out = {}
    cases, references, records = [], [], []
    for i, (name, (model_type, kinds, overrides)) in enumerate(STATE_CASES.items()):
        ckpt = _ckpt(tmp_path_factory, name, model_type, kinds, overrides, i)
        tokens, logprobs = engine.hf_greedy(ckpt, DEFAULT_PROMPTS)
        cases.append(VerifyCase(ckpt, GOLDEN / f"{model_type}.py", vllm_dtype="bfloat16"))
        references.append({"tokens": tokens, "logprobs": logprobs})
        records.append(ckpt.parent / f"{name}-modules.pt")
    for name, case, report, record in zip(
        STATE_CASES, cases, verify_many_against_hf(cases, references, records), records
    ):
        prompt = engine.record_prompt(case.prompts)
        out[name] = (report, first_state_layer_difference(case.ckpt, prompt, record, "linear_attn"))
    return out


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(FLOAT32_CASES))
def test_golden_without_state_layers_matches_hf_in_float32(float32_reports, case):
    report = float32_reports[case]
    assert report.hf_tokens and len(set(report.hf_tokens[3])) > 4, "greedy decoding degenerated into repeats"
    assert report.generated_tokens == report.hf_tokens, report.summary()
    assert report.logprob_diff_hf is not None and report.logprob_diff_hf <= LOGPROB_TOL, report.summary()
    assert report.generated_class.startswith("hfrewrite_generated_"), report.summary()
    assert report.ok, report.summary()


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(STATE_CASES))
def test_golden_gated_delta_nets_match_hf_in_bfloat16(state_reports, case):
    report, difference = state_reports[case]
    assert not report.errors and report.ran_file_under_test, report.summary()
    assert report.generated_class.startswith("hfrewrite_generated_"), report.summary()
    assert not isinstance(difference, str), difference
    name, diff = difference
    first = STATE_CASES[case][1].index(LINEAR)
    assert name == f"model.layers.{first}.linear_attn", name
    print(f"\n[{case}] {name}: {diff:.2e}")
    assert diff <= STATE_LAYER_TOL, f"{name}: {diff:.2e}"
    # the first greedy token of the longest prompt agrees (bfloat16 parts paths later)
    assert report.generated_tokens[3][0] == report.hf_tokens[3][0], report.summary()


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(STATE_CASES))
def test_gated_delta_net_layers_are_vllms(state_reports, case):
    """Gated delta nets hold vLLM's merged qkvz and ba projections, its convolution as a
    ColumnParallelLinear and a RowParallelLinear output; attention layers one
    QKVParallelLinear (q with its gate) and a RowParallelLinear; no plain nn.Linear."""
    report, _ = state_reports[case]
    model_type, kinds, _ = STATE_CASES[case]
    # an MoE block: the router, the experts, the shared expert and its gate
    moe = {"MoERunner": 1, "GateLinear": 1, "MergedColumnParallelLinear": 1, "RowParallelLinear": 1}
    moe["ReplicatedLinear"] = 1
    dense = {"MergedColumnParallelLinear": 1, "RowParallelLinear": 1}
    mlp = dense if model_type == "qwen3_5_text" else moe
    mixers = {
        LINEAR: {"MergedColumnParallelLinear": 2, "ColumnParallelLinear": 1, "RowParallelLinear": 1},
        FULL: {"QKVParallelLinear": 1, "RowParallelLinear": 1},
    }
    for kind, layer in zip(kinds, report.generated_structure):
        counted = {name: n for name, n in layer.items() if n}
        mixer = mixers[kind]
        assert counted == {k: mixer.get(k, 0) + mlp.get(k, 0) for k in {*mixer, *mlp}}, (kind, layer)


@pytest.mark.vllm
def test_a_gate_vllm_would_compute_otherwise_is_refused_by_the_file(tmp_path):
    """Qwen3.5's gated norm applies silu whatever the config says; vLLM's reads
    ``output_gate_type``: a config asking for sigmoid is refused when vLLM builds the model."""
    ckpt = make_tiny_checkpoint(
        "qwen3_5_text", tmp_path / "sigmoid", num_hidden_layers=2, layer_types=[LINEAR, FULL], **GDN
    )
    config = ckpt / "config.json"
    config.write_text(
        config.read_text().replace('"model_type"', '"output_gate_type": "sigmoid",\n  "model_type"')
    )
    tokens, logprobs = engine.hf_greedy(ckpt, DEFAULT_PROMPTS)
    case = dataclasses.replace(VerifyCase(ckpt, GOLDEN / "qwen3_5_text.py"), vllm_dtype="bfloat16")
    (report,) = verify_many_against_hf([case], [{"tokens": tokens, "logprobs": logprobs}])
    assert report.generated_tokens is None, report.summary()
    assert "this file needs getattr(config" in report.errors.get("generated", ""), report.summary()


@pytest.mark.vllm
def test_qwen3_next_golden_equals_vllms_own_in_bfloat16(tmp_path):
    """Both in bfloat16, the kernels vLLM's CPU build computes gated delta nets in: the golden
    and vLLM's own qwen3_next.py decode the same tokens with the same logprobs."""
    kinds = [LINEAR, LINEAR, FULL]
    ckpt = make_tiny_checkpoint(
        "qwen3_next", tmp_path / "next", seed=5, num_hidden_layers=3, layer_types=kinds, **GDN, **MOE
    )
    ckpt = _with_mtp_tensors(ckpt)
    (report,) = verify_many([VerifyCase(ckpt, GOLDEN / "qwen3_next.py", dtype="bfloat16")])
    assert report.generated_class.startswith("hfrewrite_generated_"), report.summary()
    assert report.native_tokens is not None and report.generated_tokens == report.native_tokens, (
        report.summary()
    )
    assert report.logprob_diff_native <= LOGPROB_TOL, report.summary()
    assert report.generated_structure == report.native_structure, report.summary()


@pytest.mark.vllm
def test_verify_model_type_proves_the_golden_as_convert_does(capsys, monkeypatch):
    """``hfrewrite verify qwen3_next --generated golden/qwen3_next.py``: the llama-like variants
    of ``verify`` do not fit a hybrid whose state layers run in bfloat16 only, so the golden is
    proven as convert proves it, in float32 with attention in every layer and in bfloat16 on
    its first gated delta net."""
    from hfrewrite.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["verify", "qwen3_next", "--generated", str(GOLDEN / "qwen3_next.py")])
    out = capsys.readouterr().out
    assert code == 0 and out.rstrip().endswith("verified"), out
    assert "the config with attention in every layer" in out and "in bfloat16" in out, out


@pytest.mark.vllm
def test_verify_checkpoint_judges_the_first_gated_delta_net(tmp_path, capsys, monkeypatch):
    """``hfrewrite verify CHECKPOINT_DIR`` (the file converted now from its config, or the
    golden given): vLLM in bfloat16 against Hugging Face in float32, judged on the first gated
    delta net on the same input; a checkpoint with multi-token-prediction tensors, as released
    ones have."""
    from hfrewrite.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    kinds = [LINEAR, LINEAR, FULL]
    ckpt = make_tiny_checkpoint(
        "qwen3_next", tmp_path / "next", seed=3, num_hidden_layers=3, layer_types=kinds, **GDN, **MOE
    )
    ckpt = _with_mtp_tensors(ckpt)
    # the file converted now from the checkpoint's config, then the golden itself
    for given in ([], ["--generated", str(GOLDEN / "qwen3_next.py")]):
        code = main(["verify", str(ckpt), *given])
        out = capsys.readouterr().out
        assert code == 0 and out.rstrip().endswith("verified"), out
        assert "it runs in bfloat16" in out and "model.layers.0.linear_attn (bfloat16):" in out, out
