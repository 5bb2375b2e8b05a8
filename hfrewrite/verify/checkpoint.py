"""``hfrewrite verify CHECKPOINT_DIR [--generated FILE] [--dtype D]``: the generated file on
the user's own weights.

Loads the checkpoint in Hugging Face and, with the generated file registered, in vLLM (one
worker process, as ``verify`` does for tiny checkpoints), decodes a few prompts greedily in
both and reports, per prompt, whether the tokens agree, the first step where they do not,
and the largest chosen-token logprob difference before it. Prompts are texts encoded with
the checkpoint's tokenizer when it has one, else fixed token ids. vLLM's own class is not
run (a third copy of the weights); ``verify MODEL_TYPE`` compares with it on tiny ones.

Refused before anything loads when the two copies would not fit: the estimate is the
parameter count (from the safetensors headers, else the file sizes) times the bytes of
``dtype``, twice, plus a fixed allowance for the engines, against the memory available now.

Pass: float32, every prompt's tokens equal and logprobs within ``LOGPROB_TOL`` (2e-4 for latent attention); bfloat16
(rounding differs between the two implementations, so greedy paths may part late), the
first token of every prompt equal and the logprobs before any divergence within
``BF16_LOGPROB_TOL``.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import tempfile
from pathlib import Path
from typing import Any

from hfrewrite.errors import HfrewriteError

PROMPT_TEXTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
)
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ENGINE_ALLOWANCE = 3 << 30  # two processes' runtimes, activations, a KV cache
BF16_LOGPROB_TOL = 0.25  # measured 0.15 on a random tiny Llama (float32: 1e-5)


def parameter_count(ckpt: Path) -> int:
    """Parameters in the checkpoint's safetensors files (headers only), else its size / 2."""
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        weights = [f for f in ckpt.iterdir() if f.suffix in (".bin", ".pt", ".pth")]
        if not weights:
            raise HfrewriteError(f"{ckpt}: no weights (*.safetensors or *.bin) in the directory")
        return sum(f.stat().st_size for f in weights) // 2
    total = 0
    for f in files:
        for entry in safetensors_header(f).values():
            count = 1
            for size in entry["shape"]:
                count *= size
            total += count
    return total


def safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor entries of a safetensors file's header, checked against the file's size:
    ``HfrewriteError`` for a truncated or corrupted file (before anything tries to load it)."""
    size = path.stat().st_size
    bad = f"{path}: not a valid safetensors file"
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise HfrewriteError(f"{bad} (only {size} bytes)")
        length = struct.unpack("<Q", head)[0]
        if length > size - 8:
            raise HfrewriteError(f"{bad} (its header claims {length} bytes; the file has {size})")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, ValueError):
            raise HfrewriteError(f"{bad} (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise HfrewriteError(f"{bad} (its header is not a JSON object)")
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    data = size - 8 - length
    for name, entry in entries.items():
        try:
            begin, end = entry["data_offsets"]
            shape_ok = all(isinstance(d, int) and d >= 0 for d in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise HfrewriteError(f"{bad} (entry {name!r} has no shape or data offsets)") from None
        if not (shape_ok and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data):
            raise HfrewriteError(
                f"{bad}: truncated or corrupted (tensor {name!r} lies at bytes {begin}..{end} "
                f"of a {data}-byte data section)"
            )
    return entries


def available_memory() -> int:
    """Bytes of memory available now (Linux ``MemAvailable``)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise HfrewriteError("cannot read the available memory (/proc/meminfo)")


def check_fits(ckpt: Path, dtype: str) -> None:
    need = 2 * parameter_count(ckpt) * BYTES[dtype] + ENGINE_ALLOWANCE
    have = available_memory()
    if need > have:
        raise HfrewriteError(
            f"{ckpt}: verifying needs about {need / 2**30:.1f} GiB (Hugging Face and vLLM copies in "
            f"{dtype}), {have / 2**30:.1f} GiB is available; try --dtype bfloat16 or a larger machine"
        )


def checkpoint_prompts(ckpt: Path) -> tuple[list[list[int]], list[str] | None]:
    """Token ids of ``PROMPT_TEXTS`` with the checkpoint's tokenizer, and the texts; the
    fixed token ids of ``fixtures.DEFAULT_PROMPTS`` (no texts, taken modulo the vocabulary
    size) when it has none."""
    import json

    from hfrewrite.verify.fixtures import DEFAULT_PROMPTS

    if not any(
        (ckpt / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        config = ckpt / "config.json"
        data = json.loads(config.read_text()) if config.exists() else {}
        vocab = data.get("vocab_size") or data.get("text_config", {}).get("vocab_size")
        vocab = vocab if isinstance(vocab, int) and vocab > 0 else None
        return [[t % vocab if vocab else t for t in p] for p in DEFAULT_PROMPTS], None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    return [tokenizer(text)["input_ids"] for text in PROMPT_TEXTS], list(PROMPT_TEXTS)


def _custom_code(ckpt: Path) -> bool:
    """Whether the checkpoint's config names its own modeling code (``auto_map``)."""
    try:
        config = json.loads((ckpt / "config.json").read_text())
    except (OSError, ValueError):
        raise HfrewriteError(f"{ckpt}/config.json: not readable JSON") from None
    return isinstance(config, dict) and bool(config.get("auto_map"))


def _analysis_release(text: str) -> str | None:
    """The transformers release a generated file's Hub custom code was analysed under, when
    it is not the installed one (the file then carries the repository's config as a shim)."""
    import transformers

    from hfrewrite.emit.config_shim import shim_classes
    from hfrewrite.emit.output import parse_header

    record = parse_header(text)
    if record is None or not shim_classes(text) or record.transformers == transformers.__version__:
        return None
    return record.transformers


def _isolated_reference(release: str, case) -> dict:
    from hfrewrite.isolate.client import run_front

    job = {"kind": "decode", "ckpt": str(case.ckpt), "prompts": [list(p) for p in case.prompts]}
    return run_front(release, {**job, "max_tokens": case.max_tokens})


def main(args: Any) -> int:
    from hfrewrite.progress import step
    from hfrewrite.verify.compare import (
        VerifyCase,
        logprob_tolerance,
        verify_many,
        verify_many_against_hf,
    )

    ckpt = Path(args.model_type)
    dtype = args.dtype or "float32"
    custom = _custom_code(ckpt)
    if custom and not args.trust_remote_code:
        raise HfrewriteError(
            f"{ckpt}: the checkpoint's config names its own code (auto_map): pass --trust-remote-code "
            "to run it in Hugging Face and vLLM"
        )
    with tempfile.TemporaryDirectory(prefix="hfrewrite-verify-") as tmp:
        generated = args.generated
        if generated is None:
            from hfrewrite import convert
            from hfrewrite.resolve import resolve

            with step(f"converting {ckpt}"):
                result = convert.generate(resolve(str(ckpt), None, bool(custom)))
            generated = Path(tmp) / result.filename
            generated.write_text(result.text)
            if args.dtype is None and result.vllm_dtype != "float32" and not custom:
                return _verify_state_layers(ckpt, generated, result, args, Path(tmp))
        elif not Path(generated).is_file():
            raise HfrewriteError(f"{generated}: no such file")
        elif args.dtype is None and not custom and (result := _facts(ckpt)) is not None:
            # a file of a model whose state layers vLLM computes in bfloat16 only
            return _verify_state_layers(ckpt, Path(generated), result, args, Path(tmp))
        check_fits(ckpt, dtype)
        prompts, texts = checkpoint_prompts(ckpt)
        case = VerifyCase(
            ckpt.resolve(),
            Path(generated).resolve(),
            prompts=prompts,
            max_tokens=args.max_tokens,
            dtype=dtype,
        )
        release = _analysis_release(Path(generated).read_text()) if custom else None
        if release is not None:  # the repository's code runs under the release it was analysed in
            with step(f"decoding {len(prompts)} prompts in Hugging Face (transformers {release})"):
                reference = _isolated_reference(release, case)
            with step(f"decoding them in vLLM with {Path(generated).name}"):
                report = verify_many_against_hf([case], [reference], timeout=600 + 60 * len(prompts))[0]
        else:
            with step(
                f"decoding {len(prompts)} prompts in Hugging Face and in vLLM with {Path(generated).name}"
            ):
                report = verify_many([case], timeout=600 + 60 * len(prompts), native=False)[0]
    print(f"vLLM instantiated {report.generated_class} from {report.generated_file}")
    if report.errors:
        for side, error in report.errors.items():
            print(f"{side} run failed:\n{error.strip()}")
        print("FAILED")
        return 1
    tol = logprob_tolerance(case.ckpt) if dtype == "float32" else BF16_LOGPROB_TOL
    ok = report.logprob_diff_hf is not None and report.logprob_diff_hf <= tol
    if not report.ran_file_under_test:
        print(f"vLLM did not run {generated}: another registration of {report.architecture} won")
        ok = False
    for at in _token_lines(report, prompts, texts):
        ok = ok and (at is None if dtype == "float32" else at != 0)
    diff = report.logprob_diff_hf
    print(
        f"max |logprob diff| before any divergence: {'n/a' if diff is None else f'{diff:.2e}'} "
        f"(tolerance {tol:g} in {dtype})"
    )
    print("verified" if ok else "FAILED")
    return 0 if ok else 1


def _facts(ckpt: Path):
    """What convert knows of the checkpoint's file beyond its text, where vLLM computes its
    state layers in bfloat16 only (else None: the file is verified in float32 as given)."""
    from hfrewrite import convert
    from hfrewrite.errors import CannotBuild
    from hfrewrite.progress import step
    from hfrewrite.resolve import resolve

    try:
        with step(f"analysing {ckpt} (the dtype vLLM computes the file in)"):
            result = convert.generate(resolve(str(ckpt)))
    except (HfrewriteError, CannotBuild):
        return None
    return result if result.vllm_dtype != "float32" else None


def _verify_state_layers(ckpt: Path, generated: Path, result, args: Any, tmp: Path) -> int:
    """A file whose state layers vLLM computes in bfloat16 only (gated delta nets), on the
    checkpoint as convert validates it (verify/state_layers.py): vLLM in bfloat16 against
    Hugging Face in float32, judged on the first state layer's output against Hugging Face's
    block run on the very input vLLM's layer was given; the greedy tokens are reported."""
    from hfrewrite.progress import step
    from hfrewrite.verify import engine
    from hfrewrite.verify.compare import VerifyCase, verify_many_against_hf
    from hfrewrite.verify.state_layers import STATE_LAYER_TOL, first_state_layer_difference

    check_fits(ckpt, "float32")
    prompts, texts = checkpoint_prompts(ckpt)
    case = VerifyCase(ckpt.resolve(), generated.resolve(), prompts=prompts, max_tokens=args.max_tokens)
    case = dataclasses.replace(case, vllm_dtype=result.vllm_dtype)
    print(
        f"vLLM computes this file's state layers in {result.vllm_dtype} only: it runs in {result.vllm_dtype}"
    )
    with step(f"decoding {len(prompts)} prompts in Hugging Face (float32) and in vLLM with {generated.name}"):
        tokens, logprobs = engine.hf_greedy(case.ckpt, prompts, args.max_tokens)
        record = tmp / "vllm-modules.pt"
        report = verify_many_against_hf([case], [{"tokens": tokens, "logprobs": logprobs}], [record])[0]
    print(f"vLLM instantiated {report.generated_class} from {report.generated_file}")
    if report.errors or not report.ran_file_under_test:
        for side, error in report.errors.items():
            print(f"{side} run failed:\n{error.strip()}")
        if not report.errors:
            print(f"vLLM did not run {generated}: another registration of {report.architecture} won")
        print("FAILED")
        return 1
    _token_lines(report, prompts, texts)
    difference = first_state_layer_difference(
        case.ckpt, engine.record_prompt(prompts), record, result.state_layer
    )
    if isinstance(difference, str):
        print(f"{difference}\nFAILED")
        return 1
    name, diff = difference
    print(
        f"{name} ({result.vllm_dtype}): {diff:.2e} from Hugging Face's on the same input (tolerance {STATE_LAYER_TOL:g}); the tokens above are reported, not judged"
    )
    print("verified" if diff <= STATE_LAYER_TOL else "FAILED")
    return 0 if diff <= STATE_LAYER_TOL else 1


def _token_lines(report, prompts, texts) -> list[int | None]:
    """Print, per prompt, whether the greedy tokens agree and where they first part; the
    first differing step of each (None: equal)."""
    from hfrewrite.verify.compare import first_difference

    steps = []
    for i, (hf, gen) in enumerate(zip(report.hf_tokens, report.generated_tokens)):
        label = repr(texts[i]) if texts else f"prompt {i} ({len(prompts[i])} token ids)"
        step = first_difference(hf, gen)
        if step is None:
            print(f"{label}: {len(hf)} greedy tokens equal")
        else:
            print(
                f"{label}: greedy tokens equal up to step {step} of {len(hf)}, then {gen[step : step + 3]} "
                f"(vLLM) vs {hf[step : step + 3]} (HF)"
            )
        steps.append(step)
    return steps
