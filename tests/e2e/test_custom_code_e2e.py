"""Hub custom code in real vLLM: `convert --trust-remote-code` validates the file it writes
against the repository's own model (tiny random weights, vLLM loading the repository's
config class with trust_remote_code), and `verify CHECKPOINT_DIR` agrees on a checkpoint
saved by the repository's code."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hfrewrite.cli import main
from hfrewrite.resolve import resolve
from hfrewrite.verify import fixtures
from hfrewrite.verify.validate import validation_config

DATA = Path(__file__).resolve().parents[1] / "data" / "custom_code"

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_interface_llama_converts_validates_and_verifies(tmp_path, capsys):
    repo = shutil.copytree(DATA / "interface_llama", tmp_path / "interface_llama")
    out = tmp_path / "out"
    assert main(["convert", str(repo), "--trust-remote-code", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "validated in vLLM against Hugging Face" in printed, printed
    assert "greedy tokens equal on 4 prompts" in printed
    generated = out / "interface_llama.py"

    # a checkpoint saved by the repository's own code (its .py files copied next to the weights)
    config = validation_config(resolve(str(repo), trust_remote_code=True).config)
    ckpt = fixtures.save_random_checkpoint(config, tmp_path / "ckpt", seed=1)
    assert (ckpt / "modeling_interface_llama.py").exists() and fixtures.runs_custom_code(ckpt)
    assert main(["verify", str(ckpt), "--generated", str(generated)]) == 0
    report = capsys.readouterr().out
    assert report.strip().endswith("verified"), report
    assert report.count("greedy tokens equal") == len(fixtures.DEFAULT_PROMPTS), report
