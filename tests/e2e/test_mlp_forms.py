"""Gated MLPs whose act vLLM has no *AndMul for (MlpForm.PAIRWISE), in real vLLM.

* ReluLLaMA-7B's shape (SparseLLM's ReLU-gated Llama-2-7B: ``hidden_act`` "relu"), which
  vLLM's own ``llama.py`` refuses: converted with validation against Hugging Face, gate and
  up each a ColumnParallelLinear around the source's ``act_fn(gate) * up``.
* Under tensor parallelism 2: MiniMax-M3's clamped SwiGLU on one [gate; up] Linear
  (tests/analyze/carried_mlps.py) becomes a MergedColumnParallelLinear whose rank-local
  output the source's own code chunks, clamps and gates, then a RowParallelLinear sums the
  ranks' parts. Hub custom code converted into a plugin (pip-installed; vLLM's TP workers
  find it by its entry point), a checkpoint saved by the repository's code; greedy tokens
  must equal Hugging Face's. Traffic on loopback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hfrewrite.cli import main
from hfrewrite.resolve import resolve
from hfrewrite.verify import compare, fixtures, runner
from hfrewrite.verify.validate import validation_config
from tests.analyze.carried_mlps import mlp_variant

TESTS = Path(__file__).resolve().parents[1]
DATA = TESTS / "data" / "custom_code" / "tinyllama_renamed"
LLAMA_2_7B = TESTS / "data" / "hub_configs" / "llama" / "meta-llama__Llama-2-7b-hf.json"
PACKAGE = "hfrewrite_tp_clamped_swiglu"

pytestmark = pytest.mark.vllm


def test_a_relu_gated_llama_converts_validated_with_its_act_on_column_shards(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = {**json.loads(LLAMA_2_7B.read_text()), "hidden_act": "relu"}
    config["_name_or_path"] = "SparseLLM/ReluLLaMA-7B"
    (tmp_path / "relu_llama").mkdir()
    (tmp_path / "relu_llama" / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert main(["convert", str(tmp_path / "relu_llama"), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (
        "validated in vLLM against Hugging Face" in printed and "greedy tokens equal on 4 prompts" in printed
    )
    text = (out / "llama.py").read_text()
    for line in (
        "self.gate_proj = ColumnParallelLinear(",
        "self.up_proj = ColumnParallelLinear(",
        "self.act_fn = ACT2FN[config.hidden_act]",
        "down_proj, _ = self.down_proj(",
        "self.act_fn(self.gate_proj(x)[0]) * self.up_proj(x)[0]",
    ):
        assert line in text, line


def test_a_clamped_swiglu_sharded_by_columns_equals_hf_at_tp2(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = shutil.copytree(DATA, tmp_path / "tinyllama_renamed_clamped_tp")
    source = repo / "modeling_tinyllama_renamed.py"
    source.write_text(mlp_variant(source.read_text(), "clamped_swiglu"))
    plugin, target = tmp_path / "plugin", tmp_path / "site"
    argv = ["convert", "--no-verify", str(repo), "--trust-remote-code", "--plugin", str(plugin)]
    assert main([*argv, "--plugin-name", PACKAGE]) == 0
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "--target", str(target), str(plugin)],
        check=True,
        capture_output=True,
    )
    config = validation_config(resolve(str(repo), trust_remote_code=True).config)
    ckpt = fixtures.save_random_checkpoint(config, tmp_path / "ckpt", seed=1)
    common = {
        "ckpt": str(ckpt),
        "prompts": [[t % config.vocab_size for t in p] for p in fixtures.DEFAULT_PROMPTS],
        "max_tokens": 16,
        "architecture": "TinyLlamaRenamedForCausalLM",
        "generated_module": None,
    }
    runs = [
        {"kind": "hf", **common},
        {"kind": "vllm", **common, "as_registered": True, "llm_kwargs": {"tensor_parallel_size": 2}},
    ]
    env = {"PYTHONPATH": str(target), "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_HOST_IP": "127.0.0.1"}
    (hf, tp), info = runner.run_worker(runs, timeout=900, env=env)
    assert "error" not in hf, hf["error"]
    assert "error" not in tp, tp["error"] + info["stderr_tail"]
    assert tp["tokens"] == hf["tokens"]
    diff = compare._max_diff(tp["tokens"], tp["logprobs"], hf["tokens"], hf["logprobs"])
    assert diff is not None and diff <= compare.LOGPROB_TOL
    assert tp["model_class"] == f"{PACKAGE}.tinyllama_renamed.TinyLlamaRenamedForCausalLM"
    layer = {kind: n for kind, n in tp["structure"][0].items() if n}
    assert layer == {"QKVParallelLinear": 1, "MergedColumnParallelLinear": 1, "RowParallelLinear": 2}
    assert info["mq_connect_ips"] == ["127.0.0.1"]
