"""Convert into a real vLLM source tree, run vLLM from it, and keep it honest with `check`.

The tree is the installed ``vllm`` package laid out in a temp folder: the package's own files
are copied, ``model_executor/models`` (where hfrewrite writes) is copied whole, and the rest
(other subpackages, the ~400 MB of compiled kernels) are symlinks into the installed
package. ``hfrewrite convert llama --vllm-tree`` is refused (vLLM maps ``LlamaForCausalLM``
to its own ``llama``), then remaps it with ``--force``, as a fork that replaces vLLM's Llama
with the generated one would. The verify worker imports vLLM from the tree (``PYTHONPATH``)
and ``LLM`` resolves the checkpoint's architecture through the edited ``registry.py`` alone:
the harness registers nothing. (tests/test_vllm_tree.py covers a new architecture name.)
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import shutil
from pathlib import Path

import pytest

from hfrewrite.cli import main
from hfrewrite.deliver.vllm_tree import REGISTRY
from hfrewrite.verify import compare, fixtures, runner

# Every test here needs the installed vLLM package (the tree is copied from it).
pytestmark = pytest.mark.vllm

MODULE = "vllm/model_executor/models/hfrewrite_llama.py"
GENERATED_CLASS = "vllm.model_executor.models.hfrewrite_llama.LlamaForCausalLM"


def copy_vllm_tree(dst: Path) -> Path:
    """A vLLM source tree at ``dst`` (``dst/vllm``) made from the installed package."""
    src = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])

    def lay_out(src_dir: Path, dst_dir: Path, copy_dirs: dict) -> None:
        dst_dir.mkdir(parents=True)
        for child in sorted(src_dir.iterdir()):
            if child.name == "__pycache__":
                continue
            target = dst_dir / child.name
            if child.is_dir() and child.name in copy_dirs:
                if copy_dirs[child.name] is None:
                    ignore = shutil.ignore_patterns("__pycache__")
                    shutil.copytree(child, target, ignore=ignore)
                else:
                    lay_out(child, target, copy_dirs[child.name])
            elif child.is_file() and child.suffix == ".py":
                shutil.copy2(child, target)
            else:
                target.symlink_to(child)

    lay_out(src, dst / "vllm", {"model_executor": {"models": None}})
    return dst


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def changed_lines(before: str, after: str) -> list[str]:
    return [
        line
        for line in difflib.unified_diff(before.splitlines(), after.splitlines(), n=0)
        if line[:1] in "+-" and line[:3] not in ("+++", "---")
    ]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> dict:
    """The tree after the conversions (registry text after each step), a checkpoint."""
    root = tmp_path_factory.mktemp("vllm-tree")
    t = copy_vllm_tree(root / "vllm-src")
    steps = {"original": (t / REGISTRY).read_text()}
    for step, force in (("refused", False), ("forced", True), ("again", True)):
        argv = ["convert", "--no-verify", "llama", "--vllm-tree", str(t)] + ["--force"] * force
        assert main(argv) == (0 if force else 2)
        steps[step] = (t / REGISTRY).read_text()
    ckpt = fixtures.make_tiny_checkpoint("llama", root / "llama")
    return {"tree": t, "steps": steps, "ckpt": ckpt}


def test_registry_edit_refused_then_forced_in_place_then_idempotent(tree):
    steps = tree["steps"]
    assert steps["refused"] == steps["original"]
    assert changed_lines(steps["original"], steps["forced"]) == [
        '-    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),',
        '+    "LlamaForCausalLM": ("hfrewrite_llama", "LlamaForCausalLM"),',
    ]
    assert steps["again"] == steps["forced"]
    # vLLM's own llama.py is untouched (still vLLM's, no hfrewrite header).
    own = tree["tree"] / "vllm/model_executor/models/llama.py"
    assert "# hfrewrite-source:" not in own.read_text()


def test_vllm_from_the_tree_loads_by_architecture_and_matches_hf(tree):
    t = tree["tree"]
    common = {
        "ckpt": str(tree["ckpt"]),
        "prompts": [list(p) for p in fixtures.DEFAULT_PROMPTS],
        "max_tokens": 16,
        "generated_module": None,
        "architecture": "LlamaForCausalLM",
    }
    # as_registered: the tree's registry decides the class, the harness registers none.
    runs = [{"kind": "hf", **common}, {"kind": "vllm", **common, "as_registered": True}]
    path = [str(t), os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in path if p)}
    (hf, run), info = runner.run_worker(runs, timeout=400, env=env)
    print(f"\nworker: import {info['import_s']}s, wall {info['wall_s']:.1f}s")
    assert "error" not in hf, hf["error"]
    assert "error" not in run, run["error"] + info["stderr_tail"]
    print(f"init {run['init_s']:.1f}s, gen {run['gen_s']:.1f}s")
    assert run["model_class"] == GENERATED_CLASS
    assert run["model_file"] == str(t / MODULE)  # vLLM imported from the tree
    assert run["tokens"] == hf["tokens"]
    diff = compare._max_diff(run["tokens"], run["logprobs"], hf["tokens"], hf["logprobs"])
    assert diff is not None and diff <= compare.LOGPROB_TOL


def test_check_tree_up_to_date_then_hand_edit_then_fix(tree, capsys):
    t = tree["tree"]
    code, out, _ = cli(capsys, "check", "--vllm-tree", t)
    assert code == 0, out
    assert f"ok       {t / MODULE}\n" in out
    assert "all 1 generated file(s) up to date" in out

    module = t / MODULE
    good = module.read_text()
    edited = good.replace("    def compute_logits(", "    # hand edit\n    def compute_logits(")
    assert edited.count("# hand edit") == 1
    module.write_text(edited)
    code, out, _ = cli(capsys, "check", "--vllm-tree", t)
    assert code == 1
    assert f"--- {module} (on disk)\n+++ {module} (regenerated)\n" in out
    assert "\n-    # hand edit\n" in out
    assert f"Update them with: hfrewrite check --vllm-tree {t} --fix" in out

    code, out, _ = cli(capsys, "check", "--vllm-tree", t, "--fix")
    assert code == 0 and module.read_text() == good
    assert cli(capsys, "check", "--vllm-tree", t)[0] == 0


def test_an_attention_free_model_runs_from_the_tree_with_its_mamba_hook(tmp_path):
    """Bamba's default config (Mamba-2 layers alone): ``config.py``'s ``MODELS_CONFIG_MAP``
    gets vLLM's Mamba hook for ``BambaForCausalLM`` (vLLM lists its own Mamba models only),
    and vLLM from the tree serves it by architecture, the harness registering nothing."""
    t = copy_vllm_tree(tmp_path / "vllm-src")
    hooks = t / "vllm/model_executor/models/config.py"
    before = hooks.read_text()
    assert main(["convert", "--no-verify", "bamba", "--vllm-tree", str(t)]) == 0
    assert changed_lines(before, hooks.read_text()) == [
        "+    # [Generated by hfrewrite]",
        '+    "BambaForCausalLM": MambaModelConfig,',
    ]
    mamba = {"mamba_n_heads": 4, "mamba_d_head": 64, "mamba_d_state": 16, "mamba_chunk_size": 4}
    ckpt = fixtures.make_tiny_checkpoint("bamba", tmp_path / "bamba", attn_layer_indices=[], **mamba)
    common = {
        "ckpt": str(ckpt),
        "prompts": [list(p) for p in fixtures.DEFAULT_PROMPTS],
        "max_tokens": 16,
        "generated_module": None,
        "architecture": "BambaForCausalLM",
    }
    runs = [{"kind": "hf", **common}, {"kind": "vllm", **common, "as_registered": True}]
    path = [str(t), os.environ.get("PYTHONPATH", "")]
    (hf, run), info = runner.run_worker(
        runs, timeout=400, env={"PYTHONPATH": os.pathsep.join(p for p in path if p)}
    )
    assert "error" not in run, run["error"] + info["stderr_tail"]
    assert run["model_class"] == "vllm.model_executor.models.hfrewrite_bamba.BambaForCausalLM"
    assert run["tokens"] == hf["tokens"] and len(set(hf["tokens"][3])) > 4
