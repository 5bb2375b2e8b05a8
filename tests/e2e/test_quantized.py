"""Quantized checkpoints through the generated files, in real vLLM, against vLLM's own files.

Real quantized tiny checkpoints are made with the ecosystem's tools from PyPI
(llm-compressor: compressed-tensors W8A8-INT8, W4A16, FP8, AWQ- and GPTQ-calibrated
W4A16; AutoAWQ: awq; GPTQModel: gptq), in their own environment (``make quant-setup``:
.venv-quant). Each golden file then decodes the quantized checkpoint in vLLM with the
checkpoint's quantization method, and so does vLLM's native implementation; the greedy tokens
must be equal and the chosen-token logprobs agree as closely as two float implementations
do (``TOL``). A multimodal checkpoint (``COMPOSITE_CASES``) is compared with vLLM's text class
on the same tensors. docs/quantization.md has the table and what does not run.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from hfrewrite.analyze.composite import text_part, with_text
from hfrewrite.verify import compare, fixtures, runner

ROOT = Path(__file__).resolve().parents[2]
QUANT_PYTHON = Path(os.environ.get("HFREWRITE_QUANT_PYTHON", ROOT / ".venv-quant" / "bin" / "python"))
SCRIPT = ROOT / "tests" / "tools" / "make_quantized.py"
# int4 kernels on CPU take bfloat16 or float16 only; int8 and fp8 run in float32
BF16 = {"w4a16", "ct-awq", "ct-gptq", "awq", "gptq"}
# ... except on a CPU with AMX tiles, where vLLM runs symmetric W8A8-INT8 with its AMX kernel
# (int8_scaled_mm_with_quant), which takes bfloat16 or float16 activations only: vLLM's own
# files fail there in float32 too
AMX_BF16 = {"w8a8"}
# vLLM's own phi.py fails on that path (the AMX int8 kernel takes 2-D inputs); the generated
# file, which carries phi's source, runs
NATIVE_FAILS_ON_AMX = {"phi-w8a8": "mat1 must be a 2D tensor"}
# vLLM 0.32's CPU build for processors without AVX-512 (its _C_AVX2 library) has no int4
# weight-only GEMM: there its own files and the generated ones load W4A16, AWQ and GPTQ
# checkpoints alike, and fail alike at the first forward
NO_INT4_GEMM = "object has no attribute 'cpu_gemm_wna16'"
# Sizes the kernels take (in_features a multiple of the 128-wide quantization groups).
SIZES = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1024,
    "num_hidden_layers": 2,
}
# model type -> (formats, extra config, llm-compressor modules left unquantized)
CASES = {
    "llama": (("w8a8", "w4a16", "fp8", "ct-awq", "ct-gptq", "awq", "gptq"), {}, ()),
    "qwen3": (("w8a8", "w4a16", "fp8", "awq", "gptq"), {}, ()),
    # tied embeddings decode a tiny random gemma3 degenerately: untied
    "gemma3_text": (("w8a8", "w4a16", "fp8"), {"tie_word_embeddings": False}, ()),
    # vLLM 0.32 on CPU has no quantized fused-MoE kernel: the experts stay float
    "qwen3_moe": (
        ("w8a8", "w4a16", "fp8"),
        {"num_experts": 4, "num_experts_per_tok": 2},
        ("re:.*mlp.experts.*",),
    ),
    # a carried-source type: LayerNorms, a parallel block, partial rope kept from the source
    "phi": (("w8a8", "w4a16", "fp8", "gptq"), {"num_key_value_heads": 4, "head_dim": None}, ()),
    # gated delta nets (their qkvz and out projections quantized; b and a, 2 x 4 value heads,
    # too narrow for the kernels, float, as vLLM's own qwen3_next.py keeps ba_proj out of
    # blockwise FP8), gated attention, experts float beside a quantized shared expert
    "qwen3_next": (
        ("w4a16", "fp8"),
        {
            "num_hidden_layers": 3,
            "layer_types": ["linear_attention", "linear_attention", "full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "shared_expert_intermediate_size": 256,
        },
        ("re:.*mlp.experts.*", "re:.*shared_expert_gate.*", "re:.*in_proj_ba.*"),
    ),
    # attention beside Mamba-2 in every layer, muP multipliers everywhere: the mixer's
    # quantized input projection under its per-column factors (ScaledMambaMixer2). Its
    # width, 2 x 256 + 2 x 16 + heads, must be a multiple of 32 for vLLM's CPU int4 kernel:
    # 32 heads of 8
    "falcon_h1": (
        ("w4a16", "fp8"),
        {
            "mamba_n_heads": 32,
            "mamba_d_head": 8,
            "mamba_d_ssm": 256,
            "mamba_d_state": 16,
            "key_multiplier": 0.8,
            "ssm_in_multiplier": 1.2,
            "ssm_out_multiplier": 0.7,
            "ssm_multipliers": [0.5, 1.4, 0.8, 1.1, 0.6],
            "mlp_multipliers": [1.25, 0.75],
            "embedding_multiplier": 1.7,
            "lm_head_multiplier": 0.6,
        },
        (),
    ),
}
# vLLM's CPU kernel of gated delta nets computes in bfloat16 only, whatever the format
GATED_DELTA_NETS = {"qwen3_next"}
# Where the file's layers are vLLM's own (llama, qwen3, gemma3_text, qwen3_moe, qwen3_next) it computes
# what native computes: tokens equal, logprobs within float32's bound (measured: 0.0, as native
# against itself). phi's LayerNorms and parallel block are the source's: in float32 they agree
# (1e-6), in bfloat16 they round in another order, as the unquantized checkpoint does (greedy
# paths part late; 0.06 before): there, verify's bfloat16 rule (every prompt's first token
# equal, logprobs before any divergence within 0.25).
EXACT_TOL, BF16_TOL = 1e-4, 0.25
CARRIED = {"phi", "falcon_h1"}  # (Falcon-H1's MLP: the source's act and multipliers per lane)
# Multimodal checkpoints quantized as their recipes do (the vision tower and projector left
# float), served by the golden's composite class (passes/composite_text.py). vLLM's own class
# for them is multimodal (it needs torchvision, which breaks vLLM's CPU build): the reference
# is vLLM's text class on the same quantized tensors, renamed to a text checkpoint.
# (llm-compressor 0.14 has no SmoothQuant mappings for the multimodal class: no w8a8 here.)
COMPOSITE_CASES = {"gemma3": (("w4a16", "fp8"), "Gemma3ForCausalLM")}
# The attention left float too, as Llama-4's FP8 releases leave it: the saved config then lists
# each attention projection under the checkpoint's name (language_model.model.layers.0.
# self_attn.q_proj), which the file must match to its own module names. Before it did, those
# layers were built as FP8 and decoded NaN, silently.
COMPOSITE_IGNORE = ("re:.*vision_tower.*", "re:.*multi_modal_projector.*", "re:.*self_attn.*")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> dict[str, Path]:
    if not QUANT_PYTHON.exists():
        if os.environ.get("HFREWRITE_REQUIRE_VLLM") == "1":
            pytest.fail(f"{QUANT_PYTHON} is missing: make quant-setup")
        pytest.skip("the quantization tools' environment is not set up (make quant-setup)")
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for model_type, (formats, extra, ignore) in CASES.items():
        sizes = {k: v for k, v in {**SIZES, **extra}.items() if v is not None}
        src = fixtures.make_tiny_checkpoint(model_type, root / "src" / model_type, **sizes)
        for fmt in formats:
            dest = root / f"{model_type}-{fmt}"
            _quantize(src, fmt, dest, ignore, root)  # GPTQModel writes logs/ in root
            out[f"{model_type}-{fmt}"] = dest
    for model_type, (formats, _) in COMPOSITE_CASES.items():
        src = _composite_checkpoint(model_type, root / "src" / model_type)
        for fmt in formats:
            dest = root / f"{model_type}-{fmt}"
            _quantize(src, fmt, dest, COMPOSITE_IGNORE, root)
            out[f"{model_type}-{fmt}"] = dest
    return out


def _quantize(src: Path, fmt: str, dest: Path, ignore, cwd: Path) -> None:
    cmd = [str(QUANT_PYTHON), str(SCRIPT), "--src", str(src), "--format", fmt, "--out", str(dest)]
    cmd += [f"--ignore={pattern}" for pattern in ignore]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, cwd=cwd)
    assert done.returncode == 0, f"{src.name} {fmt}: {done.stderr[-2000:]}"


def _composite_checkpoint(model_type: str, out: Path) -> Path:
    """A tiny multimodal checkpoint (vision tower included) whose text model has SIZES,
    untied (a tiny random tied Gemma-3 decodes degenerately)."""
    config = transformers.AutoConfig.for_model(model_type)
    text = type(text_part(config))(**{**fixtures.TINY_DEFAULTS, **SIZES, "tie_word_embeddings": False})
    config = with_text(config, text)
    config.tie_word_embeddings = False
    return fixtures.save_random_checkpoint(config, out)


def _text_checkpoint(ckpt: Path, architecture: str) -> Path:
    """The quantized multimodal checkpoint's text model as a text checkpoint of its own: the
    tool's tensors and quantization config, the text names only (``language_model.`` off)."""
    out = ckpt.with_name(ckpt.name + "-text")
    out.mkdir(exist_ok=True)
    config = json.loads((ckpt / "config.json").read_text())
    quant = config["quantization_config"]
    prefix = "language_model."
    quant["ignore"] = [name.removeprefix(prefix) for name in quant["ignore"] if name.startswith(prefix)]
    text = {**config["text_config"], "architectures": [architecture], "quantization_config": quant}
    (out / "config.json").write_text(json.dumps(text))
    renames = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head."}
    tensors = {}
    for name, tensor in load_file(ckpt / "model.safetensors").items():
        old = next((p for p in renames if name.startswith(p)), None)
        if old:
            tensors[renames[old] + name[len(old) :]] = tensor
    assert "lm_head.weight" in tensors and "model.embed_tokens.weight" in tensors, sorted(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def runs(quantized) -> dict[str, tuple[dict, dict, str]]:
    """name -> (generated run, native run, dtype), all in one vLLM worker."""
    batch, names = [], []
    for name, ckpt in quantized.items():
        model_type, fmt = name.split("-", 1)
        config = json.loads((ckpt / "config.json").read_text())
        vocab = config.get("text_config", config)["vocab_size"]
        dtype = (
            "bfloat16"
            if fmt in BF16
            or (fmt in AMX_BF16 and torch.cpu._is_amx_tile_supported())
            or model_type in GATED_DELTA_NETS
            else "float32"
        )
        common = {
            "kind": "vllm",
            "ckpt": str(ckpt),
            "prompts": [[t % vocab for t in p] for p in fixtures.DEFAULT_PROMPTS],
            "max_tokens": 16,
            "architecture": config["architectures"][0],
            "llm_kwargs": {"dtype": dtype},
        }
        batch += [{**common, "generated_module": str(ROOT / "golden" / f"{model_type}.py")}]
        if model_type in COMPOSITE_CASES:
            text_architecture = COMPOSITE_CASES[model_type][1]
            text_ckpt = _text_checkpoint(ckpt, text_architecture)
            common = {**common, "ckpt": str(text_ckpt), "architecture": text_architecture}
        batch += [{**common, "generated_module": None}]
        names.append((name, dtype))
    results, _ = runner.run_worker(batch, timeout=120 + 30 * len(batch))
    return {name: (results[2 * i], results[2 * i + 1], dtype) for i, (name, dtype) in enumerate(names)}


def _quant_method(ckpt: Path) -> str:
    config = json.loads((ckpt / "config.json").read_text())
    return config["quantization_config"]["quant_method"]


@pytest.mark.vllm
@pytest.mark.parametrize(
    "name",
    [f"{t}-{f}" for t, (formats, _, _) in CASES.items() for f in formats]
    + [f"{t}-{f}" for t, (formats, _) in COMPOSITE_CASES.items() for f in formats],
)
def test_generated_file_equals_native_on_a_quantized_checkpoint(name, runs, quantized):
    generated, native, dtype = runs[name]
    model_type = name.split("-", 1)[0]
    if not torch.cpu._is_avx512_supported() and NO_INT4_GEMM in generated.get("error", ""):
        # nothing runs int4 weights here; the test compares again where vLLM's kernel exists
        assert NO_INT4_GEMM in native.get("error", ""), native.get("error") or native["model_class"]
        return
    assert "error" not in generated, generated.get("error")
    if name in NATIVE_FAILS_ON_AMX and dtype == "bfloat16" and "error" in native:
        # nothing to compare with; the test notices when vLLM's own file runs there
        assert NATIVE_FAILS_ON_AMX[name] in native["error"], native["error"]
        assert all(len(tokens) == 16 for tokens in generated["tokens"])
        return
    assert "error" not in native, native.get("error")
    assert generated["model_class"].startswith("hfrewrite_generated_")
    assert native["model_class"].startswith("vllm.model_executor.models.")
    diff = compare._max_diff(generated["tokens"], generated["logprobs"], native["tokens"], native["logprobs"])
    print(f"\n{name} ({_quant_method(quantized[name])}, {dtype}): max |logprob diff| {diff}")
    if model_type in CARRIED and dtype == "bfloat16":
        assert all(g[0] == n[0] for g, n in zip(generated["tokens"], native["tokens"]))
        assert diff is not None and diff <= BF16_TOL
    else:
        assert generated["tokens"] == native["tokens"]
        assert diff is not None and diff <= EXACT_TOL
    # the checkpoint really is quantized: its linear weights are not float
    assert any(
        key in json.dumps(json.loads((quantized[name] / "config.json").read_text()))
        for key in ("bits", "num_bits")
    )
