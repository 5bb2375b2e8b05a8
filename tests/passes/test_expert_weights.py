"""``_experts_one_by_one`` as load_weights emits it for stacked experts, run on tensors."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hfrewrite.analyze.expert_layouts import ExpertLayout
from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.expert_weights import _stacked_experts_helper

E, H, I = 3, 4, 2  # experts, hidden, intermediate


def _split(renames):
    moe = SimpleNamespace(
        experts="experts",
        experts_layout=ExpertLayout.TRANSPOSED,
        experts_bias=False,
        checkpoint_renames=renames,
    )
    scope: dict = {}
    exec(t.code(_stacked_experts_helper(moe)), scope)  # noqa: S102 - the emitted method itself
    gate_up = torch.arange(E * H * 2 * I, dtype=torch.float32).reshape(E, H, 2 * I)
    down = torch.arange(E * I * H, dtype=torch.float32).reshape(E, I, H)
    weights = [("layers.0.mlp.experts.fc1.weight", gate_up), ("layers.0.mlp.experts.fc2.weight", down)]
    return dict(scope["_experts_one_by_one"](None, weights)), gate_up, down


def test_the_checkpoints_names_are_renamed_before_the_split():
    """Aria's checkpoint names its stacked, transposed experts ``fc1``/``fc2``; transformers
    renames them when it loads. The split reads the renamed names, so each expert's gate,
    up and down reach the fused-MoE loader, transposed back to [out, in]."""
    renames = (
        ("mlp.experts.fc1.weight", "mlp.experts.gate_up_proj"),
        ("mlp.experts.fc2.weight", "mlp.experts.down_proj"),
    )
    out, gate_up, down = _split(renames)
    assert sorted(out) == sorted(
        f"layers.0.mlp.experts.{e}.{p}.weight"
        for e in range(E)
        for p in ("gate_proj", "up_proj", "down_proj")
    )
    assert torch.equal(out["layers.0.mlp.experts.1.gate_proj.weight"], gate_up[1].T[:I])
    assert torch.equal(out["layers.0.mlp.experts.1.up_proj.weight"], gate_up[1].T[I:])
    assert torch.equal(out["layers.0.mlp.experts.2.down_proj.weight"], down[2].T)


def test_without_renames_the_checkpoints_names_pass_through():
    out, _, _ = _split(())
    assert sorted(out) == ["layers.0.mlp.experts.fc1.weight", "layers.0.mlp.experts.fc2.weight"]
