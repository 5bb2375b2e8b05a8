"""An attention-free model served through a pip-installed plugin, in real vLLM.

vLLM sizes the state blocks of attention-free models in a config hook it lists by
architecture, for its own Mamba models only: ``BambaForCausalLM`` (Bamba's default config,
Mamba-2 layers alone) starts no engine without one. The plugin ``convert --plugin`` writes
lists the architecture and gives it vLLM's Mamba hook in ``register()``; the harness registers
nothing (``as_registered``), in one process and with tensor parallelism 2 (each rank half
the Mamba-2 heads). The same package with its list emptied fails to start: the hook is what
makes the model run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hfrewrite.cli import main
from hfrewrite.verify import fixtures, runner

PACKAGE = "hfrewrite_attention_free"
MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 64, "mamba_d_state": 16, "mamba_chunk_size": 4}


def _install(src, target) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
        + ["--no-build-isolation", "--no-index", "--target", str(target), str(src)],
        check=True,
        capture_output=True,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugin-attention-free")
    src = root / "plugin"
    assert main(["convert", "--no-verify", "bamba", "--plugin", str(src), "--plugin-name", PACKAGE]) == 0
    init = src / PACKAGE / "__init__.py"
    listed = init.read_text()
    assert 'ATTENTION_FREE = (\n    "BambaForCausalLM",\n)' in listed
    _install(src, root / "site")
    init.write_text(listed.replace('    "BambaForCausalLM",\n)', ")"))  # the hook given to no one
    _install(src, root / "site-unlisted")
    ckpt = fixtures.make_tiny_checkpoint(
        "bamba", root / "ckpt", num_hidden_layers=3, attn_layer_indices=[], **MAMBA
    )
    common = {
        "ckpt": str(ckpt),
        "prompts": [list(p) for p in fixtures.DEFAULT_PROMPTS],
        "max_tokens": 16,
        "architecture": "BambaForCausalLM",
        "generated_module": None,
    }
    out = {}
    for name in ("site", "site-unlisted"):
        path = [str(root / name), os.environ.get("PYTHONPATH", "")]
        env = {
            "PYTHONPATH": os.pathsep.join(p for p in path if p),
            "VLLM_HOST_IP": "127.0.0.1",  # the tensor-parallel workers' queue stays on loopback
            "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one core per tensor-parallel worker
        }
        batch = [{"kind": "hf", **common}, {"kind": "vllm", **common, "as_registered": True}]
        if name == "site":  # and with tensor parallelism 2: each rank half the Mamba-2 heads
            batch.append({**batch[1], "llm_kwargs": {"tensor_parallel_size": 2}})
        out[name], _ = runner.run_worker(batch, timeout=900, env=env)
    return out


@pytest.mark.vllm
def test_the_plugins_hook_serves_the_attention_free_model(runs):
    hf, *served = runs["site"]
    assert len(served) == 2 and len(set(hf["tokens"][3])) > 4
    for run in served:  # one process, then tensor parallelism 2
        assert "error" not in run, run.get("error")
        assert run["model_class"] == f"{PACKAGE}.bamba.BambaForCausalLM"
        assert run["tokens"] == hf["tokens"]


@pytest.mark.vllm
def test_without_the_hook_vllm_starts_no_engine(runs):
    _, served = runs["site-unlisted"]
    assert "tokens" not in served and "mamba_block_size is not None" in served.get("error", "")
