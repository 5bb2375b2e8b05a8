"""Validating a file whose state layers vLLM computes in bfloat16 only.

vLLM's CPU kernel of gated delta nets takes bfloat16 alone, so such a file cannot run in
float32 where the layers hold them. Its validation is then two checks (convert.py names the
configs): the config with attention in every layer, where no state layer is built, in
float32 and judged as every other file (tokens equal, logprobs within float32's tolerance);
and the converted config in bfloat16 against Hugging Face in float32, judged on the output of
its first state layer, which reads the embeddings (rounded to bfloat16 only) and so differs
from Hugging Face's by bfloat16's rounding alone. Its greedy tokens are reported, not judged:
a tiny random model's routing and greedy paths part under that rounding (measured: the
first state layer of a tiny Qwen3.5-MoE 1.3e-02 from Hugging Face's, its experts' outputs
1.0 apart after a flipped routing; its greedy tokens too far apart for any logprob bound)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

# relative to Hugging Face's largest output: measured 1.3e-02 (Qwen3.5-MoE) and 2.3e-02
# (Qwen3.5) on the tiny checkpoints; in_proj_b and in_proj_a loaded swapped: 8.1e-01
STATE_LAYER_TOL = 1e-1


def judged_by_first_state_layer(report, ckpt: Path, prompt: list[int], recorded: Path, attr: str):
    """``report`` judged on the first decoder layer's ``attr`` (the state layer) on ``prompt``:
    vLLM's recorded output against Hugging Face's, within ``STATE_LAYER_TOL``."""
    if report.errors or not report.ran_file_under_test:
        return report
    difference = first_state_layer_difference(ckpt, prompt, recorded, attr)
    if isinstance(difference, str):
        return dataclasses.replace(report, ok=False, problems=(difference,))
    name, diff = difference
    if diff > STATE_LAYER_TOL:
        problem = (
            f"{name} (vLLM in bfloat16) is {diff:.1e} from Hugging Face's (tolerance {STATE_LAYER_TOL:.0e})"
        )
        return dataclasses.replace(report, ok=False, problems=(problem,))
    return dataclasses.replace(report, ok=not report.problems, state_layer_diff=diff)


def first_state_layer_difference(
    ckpt: Path, prompt: list[int], recorded: Path, attr: str
) -> tuple[str, float] | str:
    """(the module, its output's largest difference relative to Hugging Face's largest value)
    for the first decoder layer holding ``attr``; a str: why none could be compared."""
    import torch

    from hfrewrite.verify import divergence

    if not recorded.exists():
        return "vLLM recorded no module outputs"
    hf, layers = divergence.record_hf(ckpt, prompt)
    vllm = torch.load(recorded)
    for name, want in hf.items():
        parent, _, child = name.rpartition(".")
        if parent in layers and child == attr:
            rows = divergence.same_rows(want, vllm.get(name), len(prompt), False) if name in vllm else None
            if rows is None:
                return f"{name}: vLLM's output does not line up with Hugging Face's"
            got, want_rows = rows
            return name, float((got - want_rows).abs().max() / want_rows.abs().max().clamp_min(1e-12))
    return f"no decoder layer of the tiny checkpoint holds {attr}"
