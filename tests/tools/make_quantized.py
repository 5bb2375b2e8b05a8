"""Quantize a tiny float checkpoint with the ecosystem's own tools (no hand-made quantization).

Runs in the quant env (llmcompressor, gptqmodel, autoawq; see `make setup`), not in the
project's vLLM venv:

    python tests/tools/make_quantized.py --src TINY_FP_CKPT --format w8a8 --out DIR

    format   tool            checkpoint (quantization_config.quant_method)
    w8a8     llm-compressor  compressed-tensors: int8 per-channel weights, int8 dynamic
                             per-token activations (SmoothQuant + GPTQ)
    w4a16    llm-compressor  compressed-tensors: int4 symmetric, group 128, round-to-nearest
    fp8      llm-compressor  compressed-tensors: fp8 e4m3 per-channel weights, dynamic
                             per-token activations (FP8_DYNAMIC)
    ct-awq   llm-compressor  compressed-tensors: int4 asymmetric, group 128, AWQ scales
    ct-gptq  llm-compressor  compressed-tensors: int4 symmetric, group 128, GPTQ
    awq      AutoAWQ         awq: int4 GEMM layout, zero point, group 128
    gptq     GPTQModel       gptq: int4 symmetric, group 128, desc_act off

Calibration data is random token ids drawn in-process (no dataset download); the tools
that insist on a tokenizer get a stub word-level one over the ids. Linear in_features must
be multiples of 128 (e.g. hidden 256, intermediate 512). LM head and MoE routers stay
unquantized.

vLLM 0.32 on CPU loads all seven: w8a8 and fp8 in float32 or bfloat16, the int4 ones
(CPUWNA16LinearKernel) only in bfloat16 or float16. It has no quantized MoE backend on CPU:
for an MoE model pass --ignore 're:.*mlp.experts.*' (experts stay float).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import torch

GROUP = 128
SAMPLES, LENGTH = 32, 64
IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*router.*"]  # LM head, MoE routers


def random_ids(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (SAMPLES, LENGTH), generator=g).tolist()


def stub_tokenizer(vocab: int):
    """A word-level tokenizer over the ids "0".."vocab-1": calibration data is already ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = WordLevel({str(i): i for i in range(vocab)}, unk_token="0")
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(words), pad_token="0")


def llm_compressor(src: str, fmt: str, out: str, seed: int, ignore: list[str], remote: bool = False) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
    from transformers import AutoModelForCausalLM

    if not torch.accelerator.is_available():
        # llm-compressor 0.14's AWQ pins its activation cache, which fails without an
        # accelerator; pinning only speeds up host-to-device copies.
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None

    def quantize(scheme: str, gptq: bool = False):
        cls = GPTQModifier if gptq else QuantizationModifier
        return cls(targets="Linear", scheme=scheme, ignore=IGNORE + ignore)

    recipe = {
        "w8a8": [SmoothQuantModifier(smoothing_strength=0.8), quantize("W8A8", gptq=True)],
        "w4a16": [quantize("W4A16")],
        "fp8": [quantize("FP8_DYNAMIC")],
        "ct-awq": [AWQModifier(), quantize("W4A16_ASYM")],  # AWQ only rescales
        "ct-gptq": [quantize("W4A16", gptq=True)],
    }[fmt]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, trust_remote_code=remote)
    vocab = model.config.get_text_config().vocab_size  # a multimodal config's is its text part's
    ids = random_ids(vocab, seed)
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * LENGTH] * SAMPLES})
    oneshot(
        model=model,
        processor=stub_tokenizer(vocab),
        dataset=data,
        recipe=recipe,
        num_calibration_samples=SAMPLES,
        max_seq_length=LENGTH,
        trust_remote_code_model=remote,
    )
    model.save_pretrained(out, save_compressed=True)


def auto_awq(src: str, out: str, seed: int) -> None:
    from awq import AutoAWQForCausalLM

    model = AutoAWQForCausalLM.from_pretrained(src, device_map="cpu")
    config = {"zero_point": True, "q_group_size": GROUP, "w_bit": 4, "version": "GEMM"}
    model.quantize(
        None,
        quant_config=config,
        calib_data=random_ids(model.config.vocab_size, seed),
        max_calib_seq_len=LENGTH,
        n_parallel_calib_samples=8,
    )
    model.save_quantized(out)


def gptq_model(src: str, out: str, seed: int) -> None:
    # GPTQModel's CPU thread pool needs >= 2 workers; its default is cpu_count / 2
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, (os.cpu_count() or 1) // 2)))
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(src).vocab_size
    with tempfile.TemporaryDirectory() as tmp:  # GPTQModel.load wants a tokenizer on disk
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        stub_tokenizer(vocab).save_pretrained(tmp)
        model = GPTQModel.load(tmp, QuantizeConfig(bits=4, group_size=GROUP), device="cpu")
        ids = random_ids(vocab, seed)
        model.quantize([{"input_ids": x, "attention_mask": [1] * LENGTH} for x in ids], batch_size=4)
        model.save(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "quant_log.csv"):
        (Path(out) / name).unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", required=True, help="tiny float checkpoint (save_pretrained dir)")
    ap.add_argument(
        "--format", required=True, choices=["w8a8", "w4a16", "fp8", "ct-awq", "ct-gptq", "awq", "gptq"]
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ignore",
        action="append",
        default=[],
        help="more modules to leave unquantized (llm-compressor formats), e.g. "
        "'re:.*mlp.experts.*': vLLM 0.32 CPU has no quantized MoE backend",
    )
    ap.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the checkpoint's own modeling code (Hub custom code; llm-compressor formats)",
    )
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    if args.format == "awq":
        auto_awq(args.src, args.out, args.seed)
    elif args.format == "gptq":
        gptq_model(args.src, args.out, args.seed)
    else:
        llm_compressor(args.src, args.format, args.out, args.seed, args.ignore, args.trust_remote_code)


if __name__ == "__main__":
    main()
