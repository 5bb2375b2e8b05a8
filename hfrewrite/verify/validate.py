"""Convert-time translation validation: before ``convert`` writes anything, the generated
file runs in real vLLM on a tiny random checkpoint of the converted configuration and
must decode what Hugging Face decodes on the same weights.

The tiny configuration is the analysis's own shrunk copy (``shrink_config``: every flag,
the head layout, tying, one layer per layer type, MoE routing switches) with the sliding
window, when there is one, made shorter than the longest prompt so that it matters. The
reference runs in this process, from the classes the analysis traced; the generated file
runs in a vLLM worker process (``hfrewrite.verify.compare``): greedy tokens equal, chosen-token
logprobs within ``LOGPROB_TOL`` (``MLA_LOGPROB_TOL`` for latent attention).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hfrewrite.errors import CannotBuild, HfrewriteError
from hfrewrite.verify.state_layers import STATE_LAYER_TOL

WINDOW = 8  # a sliding window shorter than the longest validation prompt (40 tokens)
CHUNK = 32  # chunked attention (Llama-4) over chunks shorter than it, of whole cache blocks


@dataclass(frozen=True)
class Validation:
    prompts: int
    logprob_diff: float | None
    seconds: float
    configs: tuple[str, ...] = ("the converted config",)  # what each validated checkpoint was
    model_class: str = ""  # the class vLLM instantiated (from the file under test)
    # the widest tolerance a checkpoint was held to where it exceeds the fixed one: twice
    # transformers' own float32 error against float64 on it (compare.measured_tolerance)
    widened_tolerance: float | None = None
    # a file whose state layers vLLM computes in bfloat16 only (verify/state_layers.py): the
    # configs it ran in bfloat16, its first state layer's largest difference from Hugging
    # Face's there, and the prompts of those whose greedy tokens all agree (reported only)
    bfloat16_configs: tuple[str, ...] = ()
    state_layer_diff: float | None = None
    whole: int = 0

    def line(self) -> str:
        diff = "n/a" if self.logprob_diff is None else f"{self.logprob_diff:.1e}"
        what = (
            "this config"
            if len(self.configs) == 1
            else f"{len(self.configs)} configs ({', '.join(self.configs)})"
        )
        ran = f"; vLLM ran the generated {self.model_class}" if self.model_class else ""
        tol = (
            ""
            if self.widened_tolerance is None
            else f" (tolerance {self.widened_tolerance:.1e}: twice Hugging Face's own float32 error)"
        )
        checked = f"greedy tokens equal on {self.prompts} prompts each, max |logprob diff| {diff}{tol}"
        if self.bfloat16_configs:
            float32 = len(self.configs) - len(self.bfloat16_configs)
            checked = (f"in float32, {checked}; " if float32 else "") + (
                f"in bfloat16 (vLLM's CPU kernel of the file's state layers computes in no other) on "
                f"{len(self.bfloat16_configs)}, the first state layer {self.state_layer_diff:.1e} from "
                f"Hugging Face's in float32 (tolerance {STATE_LAYER_TOL:.0e}), greedy tokens all equal on "
                f"{self.whole} of {self.prompts * len(self.bfloat16_configs)} prompts (reported, not judged)"
            )
        return (
            f"validated in vLLM against Hugging Face on tiny random checkpoints of {what}: "
            f"{checked}{ran} ({self.seconds:.0f} s)"
        )


def validation_config(config):
    """The tiny configuration the generated file is validated on; for a multimodal config,
    itself with the tiny text config and its other parts one layer deep."""
    from hfrewrite.analyze.composite import text_part, with_text
    from hfrewrite.analyze.shrink import shrink_config

    text = text_part(config)
    if text is not None:
        return with_text(config, validation_config(text))
    small = shrink_config(config)
    small._attn_implementation = "eager"  # transformers' reference attention
    _one_more_layer(config, small)
    window = getattr(small, "sliding_window", None)
    if isinstance(window, int) and not isinstance(window, bool) and window > WINDOW:
        small.sliding_window = WINDOW
    if getattr(config, "num_experts_per_tok", None) == 1:
        # one expert per token as the config has it: a file may hold to it (Llama-4's experts
        # weight their input, which vLLM does for top-1 only); the analysis traced top-2
        small.num_experts_per_tok = 1
    if isinstance(getattr(small, "attention_chunk_size", None), int):
        small.attention_chunk_size = CHUNK  # vLLM's CPU chunks hold whole blocks of 32
    return small


# Config fields that make the first layers (or some) unlike the rest: dense before MoE.
_DENSE_LAYERS = ("first_k_dense_replace", "mlp_only_layers", "moe_layer_start_index")


def _one_more_layer(config, small) -> None:
    """One more layer like the last where the shrunk config holds one layer of a kind (a MoE
    layer after a dense one, a global layer after a sliding one): vLLM registers every
    attention and fused-MoE layer by its prefix, so a file that names two layers alike fails
    only where there are two. (Configs whose layers are all alike keep two: each layer more
    widens the random checkpoint's drift from Hugging Face.)"""
    n = getattr(small, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        return
    lists = [getattr(small, f, None) for f in ("layer_types", "mlp_layer_types")]
    single = any(isinstance(k, list) and any(k.count(x) == 1 for x in k) for k in lists)
    if not single and not any(getattr(small, f, None) for f in _DENSE_LAYERS):
        return
    from hfrewrite.analyze.shrink import extend_layers

    extend_layers(config, small, lambda items: [*items, items[-1]])
    small.num_hidden_layers = n + 1


def validate(resolved, generated, more: tuple[tuple[str, object], ...] = ()) -> Validation:
    """Run ``generated`` (a ``convert.Generated``) in vLLM against HF on the converted
    config, the sibling configs whose branches the analysis proved, and ``more``
    ((description, config) pairs: ``convert --configs``), all in one vLLM worker; raise
    ``HfrewriteError`` naming the config and the first difference when they disagree."""
    start = time.perf_counter()
    named = [("the converted config", resolved.config), *generated.sibling_configs, *more]
    outcomes = validate_each(resolved, generated, named)
    for what, report, where in outcomes:
        if not report.ok:
            on = "" if len(named) == 1 else f" on {what}"
            raise HfrewriteError(
                f"{resolved.model_type}: the generated file does not compute what Hugging Face does{on} "
                f"(validated in vLLM on a tiny random checkpoint): {report.problems[0]}{where}; "
                "nothing written"
            )
    reports = [report for _, report, _ in outcomes if report.state_layer_diff is None]
    reduced = [(what, report) for what, report, _ in outcomes if report.state_layer_diff is not None]
    diffs = [r.logprob_diff_hf for r in reports if r.logprob_diff_hf is not None]
    from hfrewrite.verify.compare import logprob_tolerance
    from hfrewrite.verify.fixtures import DEFAULT_PROMPTS

    widened = [r.logprob_tol for r in reports if r.logprob_tol > logprob_tolerance(r.ckpt)]
    first = outcomes[0][1]
    return Validation(
        len(DEFAULT_PROMPTS),
        max(diffs) if diffs else None,
        time.perf_counter() - start,
        tuple(what for what, _ in named),
        first.generated_class.rsplit(".", 1)[-1] if first.generated_class else "",
        max(widened) if widened else None,
        tuple(what for what, _ in reduced),
        max((r.state_layer_diff for _, r in reduced), default=None),
        sum(g == h for _, r in reduced for g, h in zip(r.generated_tokens or (), r.hf_tokens or ())),
    )


def validate_each(resolved, generated, named: list[tuple[str, object]]) -> list[tuple[str, object, str]]:
    """(description, ``VerifyReport``, where it first differs or "") per (description, config):
    each config shrunk, its tiny random checkpoint decoded by Hugging Face here and by the
    generated file in one vLLM worker for all of them."""
    from hfrewrite.verify import compare, engine, fixtures

    if importlib.util.find_spec("vllm") is None:
        raise HfrewriteError(
            "convert-time validation needs vLLM, which is not installed here "
            "(install it, or pass --no-verify)"
        )
    if getattr(generated, "isolated", None) is not None:
        from hfrewrite.verify.isolated import validate_isolated

        return validate_isolated(resolved, generated, named)
    with tempfile.TemporaryDirectory(prefix="hfrewrite-validate-") as tmp:
        tmp = Path(tmp)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # stderr is for hfrewrite's one error line
        module = tmp / generated.filename
        module.write_text(generated.text)
        cases, references, records = [], [], []
        for i, (what, config) in enumerate(named):
            config = validation_config(config)
            vocab = config.get_text_config().vocab_size  # (a multimodal config's text part's)
            prompts = [[t % vocab for t in p] for p in fixtures.DEFAULT_PROMPTS]
            try:
                # (named after this run: transformers keeps a checkpoint's own code by its folder's name)
                ckpt = fixtures.save_random_checkpoint(config, tmp / f"{tmp.name}-ckpt{i}")
            except Exception as exc:  # noqa: BLE001  (the modeling code cannot build it)
                raise HfrewriteError(
                    f"{resolved.model_type}: validation: cannot build a tiny checkpoint of {what}: "
                    f"{_line(exc)} (--no-verify skips the check)"
                ) from None
            # the reference runs here, from the very classes the analysis traced
            try:
                tokens, logprobs = engine.hf_greedy(ckpt, prompts)
            except Exception as exc:  # noqa: BLE001  (the model's own code fails on its checkpoint)
                # Hub custom code: its release's transformers may run it (convert retries there)
                error = CannotBuild if getattr(resolved, "custom_code", False) else HfrewriteError
                raise error(
                    f"{resolved.model_type}: validation: Hugging Face cannot decode the tiny checkpoint "
                    f"of {what}: {_line(exc)} (--no-verify skips the check)"
                ) from None
            # (bfloat16 where the file's state layers compute in no other: verify/state_layers.py)
            float32 = what in getattr(generated, "float32_siblings", ())
            vllm_dtype = "float32" if float32 else getattr(generated, "vllm_dtype", "float32")
            # (a hybrid model without state layers: vLLM's prefix caching of hybrids needs one)
            options = (("enable_prefix_caching", False),) if float32 else ()
            case = compare.VerifyCase(
                ckpt, module, prompts=prompts, vllm_dtype=vllm_dtype, engine_options=options
            )
            cases.append(case)
            references.append({"tokens": tokens, "logprobs": logprobs})
            records.append(tmp / f"vllm-modules{i}.pt")
        reports = compare.verify_many_against_hf(cases, references, records)
        state_layer = getattr(generated, "state_layer", "")
        reports = [
            _judged(report, case, ref, record, state_layer)
            for report, case, ref, record in zip(reports, cases, references, records)
        ]
        return [
            # (the module-by-module locator compares at float32's tolerance)
            (
                what,
                report,
                ""
                if report.ok or case.vllm_dtype != "float32"
                else _where(case.ckpt, engine.record_prompt(case.prompts), record),
            )
            for (what, _), case, report, record in zip(named, cases, reports, records)
        ]


def _judged(report, case, reference: dict, record: Path, state_layer: str):
    """``report`` judged as its vLLM run's dtype asks: in float32 by tokens and logprobs
    (``_measured``), in bfloat16 by the file's first state layer (verify/state_layers.py)."""
    if case.vllm_dtype == "float32":
        return _measured(report, case, reference)
    from hfrewrite.verify import engine
    from hfrewrite.verify.state_layers import judged_by_first_state_layer

    prompt = engine.record_prompt(case.prompts)
    return judged_by_first_state_layer(report, case.ckpt, prompt, record, state_layer)


def _measured(report, case, reference: dict):
    """``report`` judged again where only its logprob bound failed it (tokens equal, the file
    under test ran, no run failed, within ``MAX_LOGPROB_TOL``): against twice Hugging Face's own
    float32 error on that checkpoint (``compare.measured_tolerance``), measured only then."""
    from hfrewrite.verify import compare, engine

    diff = report.logprob_diff_hf
    only_logprobs = (
        not report.ok
        and not report.errors
        and report.ran_file_under_test
        and report.generated_tokens == report.hf_tokens
        and diff is not None
        and diff <= compare.MAX_LOGPROB_TOL
    )
    if not only_logprobs:
        return report
    error = engine.hf_float32_error(case.ckpt, case.prompts, reference["tokens"], reference["logprobs"])
    tolerance = compare.measured_tolerance(case.ckpt, error)
    if diff > tolerance:
        return dataclasses.replace(
            report,
            logprob_tol=tolerance,
            problems=(compare.logprobs_differ("HF", diff, tolerance),),
        )
    return dataclasses.replace(report, ok=True, problems=(), logprob_tol=tolerance)


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
