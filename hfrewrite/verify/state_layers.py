"""Validating a file whose state layers vLLM computes in bfloat16 only.

vLLM's CPU kernel of gated delta nets takes bfloat16 alone, so such a file cannot run in
float32 where the layers hold them. Its validation is then two checks (convert.py names the
configs): the config with attention in every layer, where no state layer is built, in
float32 and judged as every other file (tokens equal, logprobs within float32's tolerance);
and the converted config in bfloat16, judged on its first state layer: vLLM's output of it
against Hugging Face's block run in float32 on the very input vLLM's layer was given, so that
they differ by that layer's bfloat16 rounding alone. Its greedy tokens are reported, not judged:
a tiny random model's routing and greedy paths part under that rounding (measured on a tiny
Qwen3.5-MoE: its experts' outputs 1.0 apart after a flipped routing, the logprobs 0.27 apart
with both sides in bfloat16, past any bound that would still tell a wrong file)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

# relative to Hugging Face's largest output, its block run on vLLM's input: measured
# 6.9e-03 to 9.0e-03 (Qwen3.5, Qwen3.5-MoE, Qwen3-Next); in_proj_b and in_proj_a loaded
# swapped: 8.1e-01
STATE_LAYER_TOL = 5e-2


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
    for the first decoder layer's ``attr``: vLLM's recorded output against Hugging Face's
    block run here on the very input vLLM's layer was given (so that the rounding of the
    layers before it does not count); a str: why none could be compared."""
    import torch

    from hfrewrite.verify import divergence
    from hfrewrite.verify.engine import hf_model

    if not recorded.exists():
        return "vLLM recorded no module outputs"
    vllm = torch.load(recorded)
    model = hf_model(ckpt)
    layers = divergence.decoder_layer_names(model)
    for name, module in model.named_modules():
        parent, _, child = name.rpartition(".")
        if parent in layers and child == attr:
            given = vllm.get(divergence.input_key(name))
            if name not in vllm or not torch.is_tensor(given):
                return f"{name}: vLLM recorded no output or input for it"
            with torch.no_grad():
                want = module(given.reshape(1, -1, given.shape[-1]).float())
            rows = divergence.same_rows(want, vllm[name], len(prompt), False)
            if rows is None:
                return f"{name}: vLLM's output does not line up with Hugging Face's"
            got, want_rows = rows
            return name, float((got - want_rows).abs().max() / want_rows.abs().max().clamp_min(1e-12))
    return f"no decoder layer of the tiny checkpoint holds {attr}"
