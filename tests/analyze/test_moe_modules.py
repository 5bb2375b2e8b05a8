"""Experts held one module each (an nn.ModuleList dispatched by a Python loop, custom
code's way): the routing and the expert MLP are proven by replaying the block; a one-line
change to what the block computes is converted as traced or refused, never wrong."""

import shutil
from pathlib import Path

import pytest
import transformers

from hfrewrite.analyze import model as analysis
from hfrewrite.errors import HfrewriteError

DATA = Path(__file__).resolve().parents[1] / "data" / "custom_code"
LOOP_WEIGHT = "contrib = expert(flat[token_idx]) * weights[token_idx, slot, None]"


def _analyze(tmp_path, monkeypatch, old: str = "", new: str = ""):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # a directory name of its own: transformers imports a repository's code once per name
    repo = shutil.copytree(DATA / "tinymoe", tmp_path / f"tinymoe_{tmp_path.name}")
    if old:
        source = repo / "modeling_tinymoe.py"
        text = source.read_text()
        assert text.count(old) == 1, old
        source.write_text(text.replace(old, new))
    return analysis.analyze(transformers.AutoConfig.from_pretrained(repo, trust_remote_code=True))


def test_module_list_experts_are_proven_by_replay(tmp_path, monkeypatch):
    moe = _analyze(tmp_path, monkeypatch).moe
    assert (moe.router, moe.experts, moe.num_experts, moe.top_k) == ("router", "experts", 4, 2)
    assert (moe.scoring, moe.renormalize, moe.top_k_attr, moe.activation) == (
        "softmax",
        True,
        "top_k",
        "silu",
    )
    assert moe.checkpoint_expert_names == ("gate_proj", "down_proj", "up_proj")
    assert moe.expert_mlp.module_class == "TinyMoeExpert"


def test_renormalisation_switched_off_is_converted_as_traced(tmp_path, monkeypatch):
    moe = _analyze(tmp_path, monkeypatch, "if self.norm_topk_prob:", "if not self.norm_topk_prob:").moe
    assert moe.renormalize is False


@pytest.mark.parametrize(
    "new",
    [
        LOOP_WEIGHT + " + 0.1",  # a bias on every routed output
        LOOP_WEIGHT.replace("weights[token_idx, slot, None]", "weights[token_idx, slot, None] ** 2"),
        LOOP_WEIGHT.replace("expert(flat[token_idx])", "expert(flat[token_idx] * 2)"),
    ],
)
def test_what_the_fused_experts_would_not_compute_is_refused(tmp_path, monkeypatch, new):
    with pytest.raises(HfrewriteError, match="replaying the plan"):
        _analyze(tmp_path, monkeypatch, LOOP_WEIGHT, new)
