"""Hub custom code in real vLLM: `convert --trust-remote-code` validates the file it writes
against the repository's own model (tiny random weights, vLLM loading the repository's
config class with trust_remote_code), and `verify CHECKPOINT_DIR` agrees on another
checkpoint saved by the repository's code. The four test repositories: attention through
transformers' interface, an SDPA helper, a fused Wqkv with a constant causal mask and
post-norms (also taken apart into q and one k/v Linear, TeleChat-style, in either row
layout), per-expert MoE modules dispatched by a Python loop (also beside a clamped-SwiGLU
shared expert); and, kept from the source where no rewrite fits, an MLP with an inner norm
and experts under a routing of their own (a softmax at a temperature, computed densely)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hfrewrite.cli import main
from hfrewrite.resolve import resolve
from hfrewrite.verify import fixtures
from hfrewrite.verify.validate import validation_config
from tests.analyze.by_hand import attention_by_hand
from tests.analyze.carried_mlps import VARIANTS, clamped_shared_expert, mlp_variant, tempered_moe
from tests.analyze.kv_fused import q_beside_kv

DATA = Path(__file__).resolve().parents[1] / "data" / "custom_code"

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize(
    ("name", "variant"),
    [
        ("interface_llama", None),
        ("tinyllama_renamed", None),
        ("tinyllama_renamed", "by_hand"),  # its attention written out by hand (matmul, softmax)
        ("tinyllama_renamed", "inner_norm"),  # a LayerNorm inside the MLP, on gathered columns
        ("tinyllama_renamed", "sequential"),  # torch's nn.Sequential MLP: a parallel pair
        ("fusedqkv_postnorm", None),
        ("fusedqkv_postnorm", "per_head"),  # q apart, k and v in one Linear per kv head
        ("fusedqkv_postnorm", "blocks"),  # ... as [k; v]
        ("tinymoe", None),
        ("tinymoe", "clamped_shared"),  # a clamped-SwiGLU shared expert, sharded with its own code
        ("tinymoe", "tempered_dense"),  # a routing vLLM's fused MoE does not compute: block kept
    ],
)
def test_custom_code_converts_validates_and_verifies(name, variant, tmp_path, capsys):
    # (a folder name per variant: transformers keeps a repository's modules by that name)
    repo = shutil.copytree(DATA / name, tmp_path / (f"{name}_{variant}" if variant else name))
    source = repo / f"modeling_{name}.py"
    if variant == "by_hand":
        source.write_text(attention_by_hand(source.read_text()))
    elif variant in VARIANTS:
        source.write_text(mlp_variant(source.read_text(), variant))
    elif variant == "clamped_shared":
        source.write_text(clamped_shared_expert(source.read_text()))
    elif variant == "tempered_dense":
        source.write_text(tempered_moe(source.read_text(), dense=True))
    elif variant is not None:
        source.write_text(q_beside_kv(source.read_text(), variant))
    out = tmp_path / "out"
    assert main(["convert", str(repo), "--trust-remote-code", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "validated in vLLM against Hugging Face" in printed, printed
    assert "greedy tokens equal on 4 prompts" in printed
    generated = out / f"{name}.py"

    # a checkpoint saved by the repository's own code (its .py files copied next to the weights)
    config = validation_config(resolve(str(repo), trust_remote_code=True).config)
    ckpt = fixtures.save_random_checkpoint(config, tmp_path / "ckpt", seed=1)
    assert (ckpt / f"modeling_{name}.py").exists() and fixtures.runs_custom_code(ckpt)
    # the repository's code runs in both engines: only when the user says so
    assert main(["verify", str(ckpt), "--generated", str(generated)]) == 2
    assert "pass --trust-remote-code" in capsys.readouterr().err
    assert main(["verify", str(ckpt), "--generated", str(generated), "--trust-remote-code"]) == 0
    report = capsys.readouterr().out
    assert report.strip().endswith("verified"), report
    assert report.count("greedy tokens equal") == len(fixtures.DEFAULT_PROMPTS), report
