"""``hfrewrite verify MODEL_TYPE``: prove a generated file on tiny random checkpoints of
the model type (``hfrewrite.verify.checkpoint`` handles a checkpoint directory). A file
whose state layers vLLM computes in bfloat16 only (gated delta nets) is proven as convert
proves it (verify/state_layers.py): the llama-like variants below do not fit it."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from hfrewrite.progress import step
from hfrewrite.verify.compare import VerifyCase, verify_many
from hfrewrite.verify.fixtures import make_tiny_checkpoint

# Tiny-checkpoint variants `hfrewrite verify` proves a file on (valid for any
# llama-like config): GQA untied, MQA tied, MHA with head_dim != hidden/heads.
CLI_VARIANTS: dict[str, dict[str, Any]] = {
    "gqa": {},
    "mqa-tied": {"num_key_value_heads": 1, "tie_word_embeddings": True},
    "mha-head-dim-64": {"num_key_value_heads": 4, "head_dim": 64},
}


def main(args: Any) -> int:
    """``hfrewrite verify MODEL_TYPE [--generated FILE]``: prove the generated file
    (generated now when not given) on ``CLI_VARIANTS`` tiny checkpoints; print one
    summary per checkpoint. Exit code 0 when all pass, 1 otherwise."""
    from hfrewrite import convert
    from hfrewrite.errors import HfrewriteError
    from hfrewrite.resolve import resolve

    with tempfile.TemporaryDirectory(prefix="hfrewrite-verify-") as tmp:
        tmp = Path(tmp)
        generated = args.generated
        if generated is not None and not Path(generated).is_file():
            raise HfrewriteError(f"{generated}: no such file")
        resolved = resolve(args.model_type)
        with step(f"converting {args.model_type}"):  # the file, or what convert knows of it
            result = convert.generate(resolved)
        if result.vllm_dtype != "float32":
            text = Path(generated).read_text() if generated is not None else result.text
            return _as_convert_validates(resolved, dataclasses.replace(result, text=text))
        if generated is None:
            generated = tmp / result.filename
            generated.write_text(result.text)
        cases = []
        for seed, (name, overrides) in enumerate(CLI_VARIANTS.items()):
            try:
                ckpt = make_tiny_checkpoint(args.model_type, tmp / name, seed=seed, **overrides)
            except (ValueError, KeyError, TypeError) as exc:
                raise HfrewriteError(
                    f"{args.model_type}: cannot build a tiny checkpoint: " + str(exc).split(". ")[0][:200]
                ) from None
            cases.append(VerifyCase(ckpt, Path(generated).resolve()))
        with step(
            f"decoding {len(cases)} checkpoints in Hugging Face and in vLLM ({Path(generated).name}, "
            "and vLLM's own file where it has one)"
        ):
            reports = verify_many(cases)
    for name, report in zip(CLI_VARIANTS, reports):
        print(f"[{name}] {report.summary()}\n")
    print("verified" if all(r.ok for r in reports) else "FAILED")
    return 0 if all(r.ok for r in reports) else 1


def _as_convert_validates(resolved, generated) -> int:
    """A file with state layers vLLM computes in bfloat16 only, proven as convert proves it:
    with attention in every layer in float32, and on its first state layer in bfloat16."""
    from hfrewrite.errors import HfrewriteError
    from hfrewrite.verify.validate import validate

    with step(
        f"validating {generated.filename} as convert does (its state layers run in {generated.vllm_dtype})"
    ):
        try:
            validation = validate(resolved, generated)
        except HfrewriteError as exc:
            print(f"{exc}\nFAILED")
            return 1
    print(f"{validation.line()}\nverified")
    return 0
