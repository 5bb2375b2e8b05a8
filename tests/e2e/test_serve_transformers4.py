"""Hub custom code written for transformers 4.x, served: the file `convert` wrote for the
Qwen-1 test repository (and for DeepSeek-R1's Hub code with R1's YaRN config), in a
pip-installed plugin, serves a checkpoint the repository's own code saved, by vLLM's OpenAI-compatible server on 127.0.0.1, without --trust-remote-code:
the plugin registers the repository's configuration class (the file's config shim) the way
vLLM registers its own. Completions equal Hugging Face's greedy tokens under the release the
repository was written for."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hfrewrite.cli import main
from hfrewrite.isolate.client import run_front
from hfrewrite.isolate.environment import NEWEST_4X
from tests.e2e.test_serve import post, save_word_tokenizer, serving
from tests.e2e.test_transformers4_e2e import VARIANTS

DATA = Path(__file__).resolve().parents[1] / "data" / "custom_code" / "transformers4"
PACKAGE = "hfrewrite_served_legacy"
MAX_TOKENS = 12


# family -> (model type, architecture)
SERVED = {"qwen": ("qwen", "QWenLMHeadModel"), "deepseek_r1_yarn": ("deepseek_v3", "DeepseekV3ForCausalLM")}


@pytest.fixture(scope="module", params=sorted(SERVED))
def served(tmp_path_factory, request):
    name = request.param
    root = tmp_path_factory.mktemp(f"serve4_{name}")
    source, edits = VARIANTS.get(name, (name, {}))
    repo = shutil.copytree(DATA / source, root / name)
    if edits:
        config = json.loads((repo / "config.json").read_text()) | edits
        (repo / "config.json").write_text(json.dumps(config, indent=2))
    job = {"kind": "references", "model_id": str(repo), "configs": [["served", None]]}
    job |= {"prompts": [[1]], "max_tokens": 1, "out_dir": str(root / "ckpts"), "seed": 3}
    ckpt = Path(run_front(NEWEST_4X, job)["references"][0]["ckpt"])
    save_word_tokenizer(ckpt, 256)
    plugin = root / "plugin"
    args = ["convert", "--no-verify", str(repo), "--trust-remote-code", "--plugin", str(plugin)]
    assert main([*args, "--plugin-name", PACKAGE]) == 0
    with serving(root, ckpt, plugin) as port:
        yield {"port": port, "ckpt": ckpt, "log": root / "server.log", "name": name}


@pytest.mark.vllm
def test_completions_equal_the_repository_models_greedy_tokens(served, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompt = "w17 w230 w5 w99 w201"
    body = {"model": str(served["ckpt"]), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = post(served["port"], "/v1/completions", {**body, "ignore_eos": True})
    tokenizer = AutoTokenizer.from_pretrained(served["ckpt"])
    ids = tokenizer(prompt)["input_ids"]
    job = {"kind": "decode", "ckpt": str(served["ckpt"]), "prompts": [ids], "max_tokens": MAX_TOKENS}
    want = tokenizer.decode(run_front(NEWEST_4X, job)["tokens"][0])
    assert reply["choices"][0]["text"].split() == want.split()
    log = served["log"].read_text()
    model_type, architecture = SERVED[served["name"]]
    assert f"hfrewrite plugin {PACKAGE}: {architecture} -> {PACKAGE}.{model_type}:{architecture}" in log
