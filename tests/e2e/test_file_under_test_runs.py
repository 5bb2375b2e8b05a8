"""The file under test is the file that runs, even with a plugin for the same architecture
installed: ``verify`` (a checkpoint directory or a model type) registers the file after the
installed plugins have registered theirs, checks the class vLLM instantiated came from
that very file, and prints where it came from. A file broken on purpose must fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfrewrite.cli import main
from hfrewrite.verify.fixtures import make_tiny_checkpoint

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
PLANT = "        hidden_states, _ = self.norm(hidden_states, residual)\n"


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory) -> Path:
    """A llama plugin (a correct file) pip-installed into a target directory."""
    root = tmp_path_factory.mktemp("shadow")
    assert (
        main(["convert", "--no-verify", "llama", "--plugin", str(root / "src"), "--plugin-name", "shadow"])
        == 0
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "--target", str(root / "site"), str(root / "src")],
        check=True,
        capture_output=True,
    )
    return root / "site"


def _verify(target: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH")) if p),
    }
    return subprocess.run(
        [sys.executable, "-m", "hfrewrite.cli", "verify", *argv],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _planted_bug(tmp_path: Path) -> Path:
    text = (GOLDEN / "llama.py").read_text()
    assert text.count(PLANT) == 1
    bug = tmp_path / "llama_bug.py"
    bug.write_text(text.replace(PLANT, PLANT + "        hidden_states = hidden_states * 1.5\n"))
    return bug


@pytest.mark.vllm
def test_planted_bug_fails_with_a_plugin_installed(installed_plugin, tmp_path):
    ckpt = make_tiny_checkpoint("llama", tmp_path / "ckpt", seed=3)
    bug = _planted_bug(tmp_path)
    bad = _verify(installed_plugin, str(ckpt), "--generated", str(bug))
    assert bad.returncode == 1 and bad.stdout.rstrip().endswith("FAILED"), bad.stdout + bad.stderr
    assert f"from {bug.resolve()}" in bad.stdout, bad.stdout  # the planted file is what ran
    good = _verify(installed_plugin, str(ckpt), "--generated", str(GOLDEN / "llama.py"))
    assert good.returncode == 0 and good.stdout.rstrip().endswith("verified"), good.stdout + good.stderr
    assert f"from {(GOLDEN / 'llama.py').resolve()}" in good.stdout, good.stdout


@pytest.mark.vllm
def test_verify_model_type_runs_the_given_file_with_a_plugin_installed(installed_plugin, tmp_path):
    bug = _planted_bug(tmp_path)
    run = _verify(installed_plugin, "llama", "--generated", str(bug))
    assert run.returncode == 1 and run.stdout.rstrip().endswith("FAILED"), run.stdout + run.stderr
    # every variant ran the planted file, and each failed on values, not on which class ran
    assert run.stdout.count(f"from {bug.resolve()}") == 3, run.stdout
    assert "differ from HF" in run.stdout and "not the generated class" not in run.stdout
