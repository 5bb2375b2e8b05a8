"""Checkpoints saved from the base model alone, as GPT-2's, BLOOM's and OPT's own Hub
checkpoints are (``h.0.attn.c_attn.weight``, no ``transformer.``), with the causal-mask buffers old
GPT-2 checkpoints hold (``h.0.attn.bias``): transformers loads them into the causal LM by
adding the base model's prefix and ignoring those buffers, and so does the generated file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hfrewrite.cli import main
from hfrewrite.verify.fixtures import make_tiny_checkpoint

GOLDEN = Path(__file__).resolve().parents[2] / "golden"


def base_model_checkpoint(root: Path, model_type: str, legacy_buffers: bool) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    tiny = make_tiny_checkpoint(model_type, root / "tiny", seed=3)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    base = getattr(model, model.base_model_prefix)
    tensors = {name: tensor.contiguous() for name, tensor in base.state_dict().items()}
    if legacy_buffers:
        n = model.config.max_position_embeddings
        for i in range(model.config.num_hidden_layers):
            tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n)
    out = root / "base"
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text((tiny / "config.json").read_text())
    assert not any(name.startswith(model.base_model_prefix + ".") for name in tensors)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"]
    return out


@pytest.mark.vllm
# (OPT's Hub checkpoints name decoder.layers.0...: its base model is a wrapper of the decoder)
@pytest.mark.parametrize(("model_type", "legacy_buffers"), [("gpt2", True), ("bloom", False), ("opt", False)])
def test_a_base_model_checkpoint_loads(tmp_path, capsys, model_type, legacy_buffers):
    ckpt = base_model_checkpoint(tmp_path, model_type, legacy_buffers)
    code = main(["verify", str(ckpt), "--generated", str(GOLDEN / f"{model_type}.py")])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.strip().splitlines()
    assert lines[-1] == "verified"
    assert all("16 greedy tokens equal" in line for line in lines if line.startswith("prompt "))


@pytest.mark.vllm
def test_gpt_neox_checkpoint_with_its_legacy_buffers_loads(tmp_path, capsys):
    """Pythia's checkpoints hold ``gpt_neox.layers.N.attention.bias`` and ``masked_bias``,
    which transformers declares unexpected; the golden, which renames ``embed_out`` to
    ``lm_head``, loads such a checkpoint and equals Hugging Face on it."""
    import torch
    from safetensors.torch import load_file, save_file

    ckpt = make_tiny_checkpoint("gpt_neox", tmp_path / "ckpt", seed=3)
    tensors = load_file(ckpt / "model.safetensors")
    config = json.loads((ckpt / "config.json").read_text())
    n = config["max_position_embeddings"]
    for i in range(config["num_hidden_layers"]):
        tensors[f"gpt_neox.layers.{i}.attention.bias"] = torch.tril(torch.ones(n, n, dtype=torch.bool))
        tensors[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    code = main(["verify", str(ckpt), "--generated", str(GOLDEN / "gpt_neox.py")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.strip().splitlines()[-1] == "verified"
