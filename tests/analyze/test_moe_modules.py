"""Experts held one module each (an nn.ModuleList dispatched by a Python loop, custom
code's way): the routing and the expert MLP are proven by replaying the block; a one-line
change to what the block computes is converted as traced or refused, never wrong."""

import shutil
from pathlib import Path

import pytest
import transformers

from hfrewrite.analyze import model as analysis
from hfrewrite.analyze.router_scorings import Scoring
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
        Scoring.SOFTMAX,
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


WEIGHTED_EXPERT = (
    (
        "    def forward(self, x):\n        return self.down_proj(",
        "    def forward(self, x, w):\n        return w * self.down_proj(",
    ),
    (LOOP_WEIGHT, "contrib = expert(flat[token_idx], weights[token_idx, slot, None])"),
    # the sum buffer built from sizes alone (Mixtral 4.36): traced, so the sum stays in the graph
    ("out = torch.zeros_like(flat)", "out = torch.zeros(flat.shape, dtype=flat.dtype)"),
)


def _weighted(tmp_path, monkeypatch, expert_forward: str):
    edits = [(WEIGHTED_EXPERT[0][0], expert_forward), *WEIGHTED_EXPERT[1:]]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = shutil.copytree(DATA / "tinymoe", tmp_path / f"tinymoe_{tmp_path.name}")
    source = repo / "modeling_tinymoe.py"
    text = source.read_text()
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    source.write_text(text)
    return analysis.analyze(transformers.AutoConfig.from_pretrained(repo, trust_remote_code=True))


def test_experts_that_scale_their_output_by_the_routing_weights_are_proven(tmp_path, monkeypatch):
    moe = _weighted(tmp_path, monkeypatch, WEIGHTED_EXPERT[0][1]).moe
    assert moe.expert_mlp.module_class == "TinyMoeExpert" and moe.top_k == 2
    assert moe.checkpoint_expert_names == ("gate_proj", "down_proj", "up_proj")


def test_experts_using_the_routing_weights_otherwise_are_refused(tmp_path, monkeypatch):
    forward = "    def forward(self, x, w):\n        return self.down_proj(w * "
    with pytest.raises(HfrewriteError, match="routing weights other than as a last scaling"):
        _weighted(tmp_path, monkeypatch, forward)
