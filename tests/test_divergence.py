"""divergence.first_divergence: which module first differs, read from recorded outputs.

Hugging Face's side is recorded from a real tiny llama; the other side is built from it
the way vLLM's modules return their outputs (tokens flattened, a fused layer's
``(hidden_states, residual)`` pair, a fused norm's ``(normed, residual)``), then changed
in one module. The real vLLM recording runs in tests/e2e/test_convert_validation.py."""

from __future__ import annotations

import pytest
import torch
import transformers

from hfrewrite.verify import divergence, fixtures

PROMPT = list(range(3, 23))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    ckpt = fixtures.save_random_checkpoint(config, tmp_path_factory.mktemp("ckpt") / "llama")
    return divergence.record_hf(ckpt, PROMPT)


def as_vllm(hf: dict, layers: set[str], rows: int = len(PROMPT)) -> dict:
    """The outputs as vLLM's modules give them, for the prompt's last ``rows`` tokens."""
    out = {}
    for name, value in hf.items():
        x = value[0] if isinstance(value, tuple) else value
        if not torch.is_tensor(x):
            continue
        x = x.reshape(len(PROMPT), -1)[-rows:]
        residual = torch.randn_like(x)
        if name in layers:
            out[name] = (x - residual, residual)
        elif name.endswith("layernorm"):
            out[name] = (x, residual)
        else:
            out[name] = x
    return out


def test_layers_and_their_blocks_are_found(recorded):
    _, layers = recorded
    assert layers == {"model.layers.0", "model.layers.1"}


def test_agreeing_outputs_point_past_the_layers(recorded):
    hf, layers = recorded
    found = divergence.first_divergence(hf, layers, as_vllm(hf, layers), len(PROMPT))
    assert found.endswith("agree; it differs after them (lm_head or logits)"), found


@pytest.mark.parametrize("rows", [len(PROMPT), 5])  # 5: vLLM ran only the tail (a cached prefix)
def test_the_first_changed_module_is_named(recorded, rows):
    hf, layers = recorded
    vllm = as_vllm(hf, layers, rows)
    vllm["model.layers.1.self_attn"] = vllm["model.layers.1.self_attn"] + 0.5
    vllm["model.layers.1"] = (
        vllm["model.layers.1"][0] + 0.5,
        vllm["model.layers.1"][1],
    )
    found = divergence.first_divergence(hf, layers, vllm, len(PROMPT))
    assert found.startswith("first differs at model.layers.1.self_attn (max |diff| 5.0e-01; the "), found


def test_noise_below_the_tolerance_is_agreement(recorded):
    hf, layers = recorded
    vllm = as_vllm(hf, layers)
    vllm["model.layers.0.mlp"] = vllm["model.layers.0.mlp"] + 1e-6
    assert "agree" in divergence.first_divergence(hf, layers, vllm, len(PROMPT))


class SharedAct(torch.nn.Module):
    """One activation module called by two blocks (vLLM shares its ``*AndMul`` modules)."""

    def __init__(self):
        super().__init__()
        self.act = torch.nn.SiLU()
        self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.first.act = self.second.act = self.act

    def forward(self, x):
        return self.second.act(self.second(self.first.act(self.first(x))))


def test_recording_leaves_what_the_model_computes_unchanged():
    model, x = SharedAct(), torch.randn(3, 4)
    want = model(x)
    divergence.start_recording(model)
    try:
        got = model(x)
    finally:
        divergence.stop_recording(model)
    assert torch.equal(got, want)
    assert torch.equal(
        divergence._RECORDED["act"], torch.nn.functional.silu(model.first(x))
    )  # its first call
