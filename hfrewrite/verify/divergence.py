"""Where a generated file first computes something else than Hugging Face.

When convert-time validation finds different tokens or logprobs, both sides run one
prompt again with forward hooks on every module; the outputs of the modules the two
models share by name (the embeddings, each decoder layer, the layer's direct children:
norms, attention, MLP, and the final norm) are compared in the order Hugging Face ran
them. The first that differs is named in the error.

Conventions of vLLM's side, taken into account: tokens are flattened (no batch dim); a
fused-residual norm returns ``(normed, residual)``; a fused decoder layer returns
``(hidden_states, residual)``, whose sum is Hugging Face's layer output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Outputs recorded by the hooks of the vLLM run in this process (the in-process engine
# runs ``apply_model`` functions here).
_RECORDED: dict[str, Any] = {}
_HOOKS: list[Any] = []
TOLERANCE = 1e-4  # relative to the reference's largest magnitude


def _keep(output: Any) -> Any:
    """Tensors (or a tuple's tensors) detached to the CPU; other outputs as None."""
    import torch

    if torch.is_tensor(output):
        return output.detach().float().cpu().clone()
    if isinstance(output, (tuple, list)):
        return tuple(_keep(o) for o in output)
    return None


def _hook(recorded: dict[str, Any], name: str):
    """A forward hook keeping the module's first output under ``name`` and its first
    input under ``input_key(name)``; it returns None, which leaves the output as it is (a
    module shared by layers runs again)."""

    def hook(_module, args, output) -> None:
        if name not in recorded:
            recorded[name] = _keep(output)
            recorded[input_key(name)] = _keep(args[0]) if args else None

    return hook


def input_key(name: str) -> str:
    """Where a recording keeps module ``name``'s first input."""
    return f"{name}:input"


def start_recording(model: Any) -> None:
    """Hook every submodule of ``model`` (an ``apply_model`` function)."""
    _RECORDED.clear()
    _HOOKS.extend(
        module.register_forward_hook(_hook(_RECORDED, name)) for name, module in model.named_modules() if name
    )


def stop_recording(model: Any) -> None:
    while _HOOKS:
        _HOOKS.pop().remove()


def record_vllm(llm: Any, prompt: list[int], out: Path) -> None:
    """One forward pass of ``prompt`` in ``llm`` with every module's output saved to ``out``."""
    import torch
    from vllm import SamplingParams

    llm.apply_model(start_recording)
    try:
        llm.generate(
            [{"prompt_token_ids": list(prompt)}],
            SamplingParams(temperature=0, max_tokens=1),
            use_tqdm=False,
        )
    finally:
        llm.apply_model(stop_recording)
    torch.save(dict(_RECORDED), out)
    _RECORDED.clear()


def record_hf(ckpt: Path, prompt: list[int]) -> tuple[dict[str, Any], set[str]]:
    """Every module's output of one Hugging Face forward pass over ``prompt`` (in the order
    they finished), and the names of the decoder layers (the outermost ModuleList's children)."""
    import torch

    from hfrewrite.verify.engine import hf_model

    model = hf_model(ckpt)
    recorded: dict[str, Any] = {}
    hooks = [
        module.register_forward_hook(_hook(recorded, name)) for name, module in model.named_modules() if name
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([list(prompt)]))
    finally:
        for hook in hooks:
            hook.remove()
    return recorded, decoder_layer_names(model)


def decoder_layer_names(model: Any) -> set[str]:
    """The names of the decoder layers: the outermost ModuleList's children."""
    import torch

    lists = {
        name: len(module) for name, module in model.named_modules() if isinstance(module, torch.nn.ModuleList)
    }
    stack = min(lists, key=lambda name: (name.count("."), name)) if lists else None
    return {f"{stack}.{i}" for i in range(lists[stack])} if stack else set()


def _tensor(x: Any, layer: bool) -> Any:
    """The tensor a module output stands for: a fused layer's pair summed, else a tuple's first."""
    import torch

    if isinstance(x, tuple):
        parts = [p for p in x if torch.is_tensor(p)]
        if not parts:
            return None
        return (
            parts[0] + parts[1]
            if layer and len(parts) == 2 and parts[0].shape == parts[1].shape
            else parts[0]
        )
    return x if torch.is_tensor(x) and x.numel() else None


def same_rows(want: Any, got: Any, tokens: int, layer: bool) -> tuple[Any, Any] | None:
    """(vLLM's, Hugging Face's) outputs of one module as [tokens, features] rows, the rows
    vLLM ran (a cached prefix it skipped left out); None where they cannot be lined up."""
    b, a = _tensor(want, False), _tensor(got, layer)
    if a is None or b is None or b.numel() % tokens or a.numel() % (b.numel() // tokens):
        return None
    b = b.reshape(tokens, -1)
    a = a.reshape(-1, b.shape[1])
    if a.shape[0] > tokens:
        return None
    return a, b[tokens - a.shape[0] :]


def first_divergence(hf: dict[str, Any], layers: set[str], vllm: dict[str, Any], tokens: int) -> str:
    """A sentence naming the first module (in Hugging Face's order) whose output differs.

    Compared: the decoder layers, their direct children and the base model's other direct
    children (embeddings, final norm), by name. vLLM may have run only the prompt's last
    tokens (a cached prefix); those rows are compared."""
    stacks = {n.rpartition(".")[0] for n in layers}  # "model.layers"
    bases = {s.rpartition(".")[0] for s in stacks}  # "model"
    agreed = 0
    for name, want in hf.items():
        if name.endswith(input_key("")):  # the modules' inputs: their outputs are compared
            continue
        parent = name.rpartition(".")[0]
        if name not in vllm or not (name in layers or parent in layers or parent in bases):
            continue
        rows = same_rows(want, vllm[name], tokens, name in layers)
        if rows is None:
            continue
        a, b = rows
        diff = (a - b).abs().max().item()
        if diff > TOLERANCE * max(1.0, b.abs().max().item()):
            where = f"first differs at {name} (max |diff| {diff:.1e}"
            return where + (f"; the {agreed} module outputs before it agree)" if agreed else ")")
        agreed += 1
    if not agreed:
        return "no module output could be compared by name"
    return f"the {agreed} compared module outputs agree; it differs after them (lm_head or logits)"
