"""Hunyuan's NTK alpha (``rope_type: dynamic`` with ``alpha``, as Hunyuan-7B and Hy-MT2-7B
release it): the replay computes vLLM's ``DynamicNTKAlphaRotaryEmbedding``, so a checkpoint
with it converts; the same config with its alpha dropped from the replay does not prove."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from hfrewrite.analyze import rope
from hfrewrite.cli import main

ALPHA = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}


@pytest.mark.vllm
def test_the_alpha_replica_equals_vllms_table():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.dynamic_ntk_alpha_rope import (
        DynamicNTKAlphaRotaryEmbedding,
    )

    rotary, length = 64, 16
    with set_current_vllm_config(VllmConfig()):
        vllm_rope = DynamicNTKAlphaRotaryEmbedding(
            rotary, rotary, length, 10000.0, True, 1000.0, torch.float32
        )
    inv_freq, scale = rope._inv_freq(None, ALPHA, None, rotary)
    freqs = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()
    assert scale == 1.0
    torch.testing.assert_close(table, vllm_rope.cos_sin_cache.float(), rtol=1e-5, atol=1e-5)


def _checkpoint_dir(tmp_path):
    config = transformers.AutoConfig.for_model(
        "hunyuan_v1_dense",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_parameters=ALPHA,
    )
    path = tmp_path / "hy"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    return path


def test_a_hunyuan_checkpoint_with_an_ntk_alpha_converts(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", str(_checkpoint_dir(tmp_path)), "--no-verify", "-o", str(out)]) == 0
    text = (out / "hunyuan_v1_dense.py").read_text()
    assert "rope_parameters=config.rope_parameters" in text  # vLLM reads the alpha from it


def test_without_the_alpha_in_the_replay_the_rope_is_not_proven(tmp_path, capsys, monkeypatch):
    original = rope._inv_freq

    def ignoring_alpha(config, params, layer_type, rotary_dim):
        return original(config, {k: v for k, v in params.items() if k != "alpha"}, layer_type, rotary_dim)

    monkeypatch.setattr(rope, "_inv_freq", ignoring_alpha)
    code = main(["convert", str(_checkpoint_dir(tmp_path)), "--no-verify", "-o", str(tmp_path / "out")])
    assert code == 2
    assert "a base the source computes" in capsys.readouterr().err
