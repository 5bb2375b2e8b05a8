"""The repositories in tests/data/custom_code/transformers4/ are Hub custom code as written
for transformers 4.x: each is a correct causal LM under the release hfrewrite analyses such
code with (the overlay `make setup` installs; checked in a child process, as the analysis
runs), and `convert` picks that release for them by itself."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hfrewrite.isolate.environment import NEWEST_4X, choose_version, ensure_overlay

DATA = Path(__file__).parent / "data" / "custom_code" / "transformers4"
NAMES = sorted(p.name for p in DATA.iterdir() if p.is_dir())
CHECK = Path(__file__).parent / "tools" / "check_transformers4_repo.py"


def test_the_families():
    assert NAMES == [
        "baichuan2",
        "baichuan_13b",
        "chatglm",
        "deepseek",
        "ernie4_5",
        "falcon_rw",
        "internlm2",
        "minicpm",
        "oldmoe_sizes",
        "openelm",
        "qwen",
        "stablelm_epoch",
        "telechat",
    ]
    for name in NAMES:
        files = sorted(p.name for p in (DATA / name).iterdir() if p.name != "__pycache__")
        assert files == ["config.json", f"configuration_{name}.py", f"modeling_{name}.py"], name
        config = json.loads((DATA / name / "config.json").read_text())
        assert config["transformers_version"].startswith("4."), name
        assert "AutoModelForCausalLM" in config["auto_map"], name


@pytest.mark.parametrize("name", NAMES)
def test_each_is_analysed_under_the_newest_4x_release(name):
    config = json.loads((DATA / name / "config.json").read_text())
    version, why = choose_version(config, None)
    assert version == NEWEST_4X and config["transformers_version"] in why


def test_each_is_a_causal_lm_under_its_release(tmp_path):
    overlay = ensure_overlay(NEWEST_4X)  # make setup installed it; offline here
    repos = [shutil.copytree(DATA / n, tmp_path / n) for n in NAMES]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(overlay), os.environ.get("PYTHONPATH", "")])}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    done = subprocess.run(
        [sys.executable, str(CHECK), *map(str, repos)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [Path(r["repo"]).name for r in results] == NAMES
    for r in results:
        assert r["reloads"] and r["cache_equals_recompute"], r
        assert r["distinct"] > 1, r  # greedy decoding does not collapse into one token


def test_chatglm_converts_through_its_nested_layout(tmp_path, capsys, monkeypatch):
    """ChatGLM3's parts sit at three depths (embedding.word_embeddings, encoder.layers,
    encoder.final_layernorm, output_layer) and its layers run sequence first, with a rope
    helper compiled by TorchScript, a partial interleaved rope of base 10000 * rope_ratio (both
    tied to the config by sibling analyses) and a swiglu closure: the file builds its parts in
    one flat base model, with vLLM's rope over half of each head, and refuses the configs whose
    branches it does not build (the per-head q/k/v split of multi_query_attention=False)."""
    from hfrewrite.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = shutil.copytree(DATA / "chatglm", tmp_path / "chatglm")
    assert (
        main(["convert", str(repo), "--trust-remote-code", "--no-verify", "-o", str(tmp_path / "out")]) == 0
    )
    text = (tmp_path / "out" / "chatglm.py").read_text()
    for shows in (
        '"rope_theta": 10000.0 * config.rope_ratio',
        '"partial_rotary_factor": 0.5',
        "is_neox_style=False",
        "if not (config.multi_query_attention):",
        '"transformer.encoder.layers.": "transformer.layers.",',
        '"transformer.rotary_pos_emb.": None,',
        "self.output_layer = ParallelLMHead(",
    ):
        assert shows in text, shows
