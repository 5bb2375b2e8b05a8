"""The Hub-custom-code test models in tests/data/custom_code/ are correct causal LMs under transformers.

Each directory holds only code and a config (no weights): the model is built with a fixed seed, its random
weights saved and reloaded, and greedy `generate` (KV cache) must agree with the reloaded model and with
argmax over step-by-step full forwards without a cache. Loading without `trust_remote_code` must refuse.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

DATA = Path(__file__).parent / "data" / "custom_code"
NAMES = ["tinyllama_renamed", "fusedqkv_postnorm", "tinymoe", "interface_llama"]
PROMPT = [[3, 17, 42, 101, 7, 250, 64, 9]]
NEW_TOKENS = 8


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _greedy(model, prompt: torch.Tensor) -> torch.Tensor:
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
    return out[:, prompt.shape[1] :]


def _greedy_no_cache(model, prompt: torch.Tensor) -> torch.Tensor:
    ids = prompt
    for _ in range(NEW_TOKENS):
        logits = model(input_ids=ids, use_cache=False).logits
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, prompt.shape[1] :]


def test_data_dirs_are_code_only():
    # transformers4/: repositories written for transformers 4.x (tests/test_transformers4_data.py)
    assert sorted(p.name for p in DATA.iterdir() if p.is_dir() and p.name != "transformers4") == sorted(NAMES)
    for name in NAMES:
        files = sorted(p.name for p in (DATA / name).iterdir() if p.name != "__pycache__")
        assert files == ["config.json", f"configuration_{name}.py", f"modeling_{name}.py"]


@pytest.mark.parametrize("name", NAMES)
def test_custom_code_model_is_a_causal_lm(name, tmp_path):
    d = tmp_path / name
    shutil.copytree(DATA / name, d, ignore=shutil.ignore_patterns("__pycache__"))

    config = AutoConfig.from_pretrained(d, trust_remote_code=True)
    assert config.model_type == name
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True).eval()
    assert type(model).__name__ == config.architectures[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model.save_pretrained(d)
    assert (d / "model.safetensors").exists()

    reloaded = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
    ref = model.state_dict()
    got = reloaded.state_dict()
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref)

    prompt = torch.tensor(PROMPT)
    with torch.no_grad():
        first = _greedy(model, prompt)
        assert first.shape == (1, NEW_TOKENS)
        assert torch.equal(first, _greedy(model, prompt))
        assert torch.equal(first, _greedy(reloaded, prompt))
        assert torch.equal(first, _greedy_no_cache(reloaded, prompt))
        # Prefill with a cache gives the same logits as the full forward without one.
        full = reloaded(input_ids=prompt, use_cache=False).logits
        cached = reloaded(input_ids=prompt, use_cache=True).logits
        torch.testing.assert_close(cached, full)
        # Causality: logits at a position do not depend on later tokens.
        changed = prompt.clone()
        changed[0, -1] = (changed[0, -1] + 1) % config.vocab_size
        torch.testing.assert_close(reloaded(input_ids=changed, use_cache=False).logits[:, :-1], full[:, :-1])

    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoConfig.from_pretrained(d, trust_remote_code=False)
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(d, trust_remote_code=False)
