"""Convert-time translation validation: before ``convert`` writes anything, the generated
file runs in real vLLM on a tiny random checkpoint of the converted configuration and
must decode what Hugging Face decodes on the same weights.

The tiny configuration is the analysis's own shrunk copy (``shrink_config``: every flag,
the head layout, tying, one layer per layer type, MoE routing switches) with the sliding
window, when there is one, made shorter than the longest prompt so that it matters. The
reference runs in this process, from the classes the analysis traced; the generated file
runs in a vLLM worker process (``hfrewrite.verify.compare``): greedy tokens equal, chosen-token
logprobs within ``LOGPROB_TOL``.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hfrewrite.errors import HfrewriteError

WINDOW = 8  # a sliding window shorter than the longest validation prompt (40 tokens)


@dataclass(frozen=True)
class Validation:
    prompts: int
    logprob_diff: float | None
    seconds: float

    def line(self) -> str:
        diff = "n/a" if self.logprob_diff is None else f"{self.logprob_diff:.1e}"
        return (
            f"validated in vLLM against Hugging Face on a tiny random checkpoint of this config: "
            f"greedy tokens equal on {self.prompts} prompts, max |logprob diff| {diff} "
            f"({self.seconds:.0f} s)"
        )


def validation_config(config):
    """The tiny configuration the generated file is validated on."""
    from hfrewrite.analyze.shrink import shrink_config

    small = shrink_config(config)
    small._attn_implementation = "eager"  # transformers' reference attention
    window = getattr(small, "sliding_window", None)
    if isinstance(window, int) and not isinstance(window, bool) and window > WINDOW:
        small.sliding_window = WINDOW
    return small


def validate(resolved, generated) -> Validation:
    """Run ``generated`` (a ``convert.Generated``) in vLLM against HF; raise
    ``HfrewriteError`` naming the first difference when they disagree."""
    from hfrewrite.verify import compare, engine, fixtures

    if importlib.util.find_spec("vllm") is None:
        raise HfrewriteError(
            "convert-time validation needs vLLM, which is not installed here "
            "(install it, or pass --no-verify)"
        )
    start = time.perf_counter()
    config = validation_config(resolved.config)
    prompts = [[t % config.vocab_size for t in p] for p in fixtures.DEFAULT_PROMPTS]
    with tempfile.TemporaryDirectory(prefix="hfrewrite-validate-") as tmp:
        tmp = Path(tmp)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # stderr is for hfrewrite's one error line
        try:
            ckpt = fixtures.save_random_checkpoint(config, tmp / "ckpt")
        except Exception as exc:  # noqa: BLE001  (the modeling code cannot build it)
            raise HfrewriteError(
                f"{resolved.model_type}: validation: cannot build a tiny checkpoint of this "
                f"config: {_line(exc)} (--no-verify skips the check)"
            ) from None
        module = tmp / generated.filename
        module.write_text(generated.text)
        # the reference runs here, from the very classes the analysis traced
        tokens, logprobs = engine.hf_greedy(ckpt, prompts)
        case = compare.VerifyCase(ckpt, module, prompts=prompts)
        recorded = tmp / "vllm-modules.pt"
        report = compare.verify_against_hf(case, {"tokens": tokens, "logprobs": logprobs}, record=recorded)
        where = "" if report.ok else _where(ckpt, engine.record_prompt(prompts), recorded)
    if not report.ok:
        raise HfrewriteError(
            f"{resolved.model_type}: the generated file does not compute what Hugging Face does "
            f"(validated in vLLM on a tiny random checkpoint): {report.problems[0]}{where}; nothing written"
        )
    return Validation(len(prompts), report.logprob_diff_hf, time.perf_counter() - start)


def _where(ckpt: Path, prompt: list[int], recorded: Path) -> str:
    """ "; <which module first differs>" from the vLLM run's recorded module outputs and
    Hugging Face's on the same prompt; "" when there is no recording to compare."""
    import torch

    from hfrewrite.verify import divergence

    if not recorded.exists():
        return ""
    try:
        hf, layers = divergence.record_hf(ckpt, prompt)
        return "; " + divergence.first_divergence(hf, layers, torch.load(recorded), len(prompt))
    except Exception:  # noqa: BLE001  (a diagnosis only: the error stands without it)
        return ""


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
