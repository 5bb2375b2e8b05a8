"""A module the MoE block runs on its whole output (A.X-K1's ``post_mlp_layernorm`` after the
shared expert is added): the plan names it, the replay runs it after vLLM's fused MoE, and
the emitted block returns it applied to the runner's output. Where the same norm stands
elsewhere (on the routed experts' output only), the replay refuses the block."""

from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.axk1 import modeling_axk1

from hfrewrite.analyze.model import analyze
from hfrewrite.errors import HfrewriteError

GOLDEN = Path(__file__).resolve().parents[2] / "golden"


def test_the_block_norm_is_the_plans_output_module():
    plan = analyze(transformers.AutoConfig.for_model("axk1"))
    assert plan.moe.output_module == "post_mlp_layernorm"
    assert plan.moe.shared_expert == "shared_experts"


def test_a_block_without_one_has_none():
    assert analyze(transformers.AutoConfig.for_model("qwen3_moe")).moe.output_module is None


def test_the_golden_runs_it_on_the_runners_output():
    src = (GOLDEN / "axk1.py").read_text()
    assert "return self.post_mlp_layernorm(final_hidden_states.view(orig_shape))" in src
    assert "self.post_mlp_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)" in src


def _norm_before_the_shared_expert(self, hidden_states: torch.Tensor) -> torch.Tensor:
    residuals = hidden_states
    orig_shape = hidden_states.shape
    _, topk_weights, topk_indices = self.gate(hidden_states)
    hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
    hidden_states = self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)
    return self.post_mlp_layernorm(hidden_states) + self.shared_experts(residuals)


def test_the_norm_on_the_routed_output_alone_is_refused(monkeypatch):
    monkeypatch.setattr(modeling_axk1.AXK1MoE, "forward", _norm_before_the_shared_expert)
    with pytest.raises(HfrewriteError, match="differs from the block"):
        analyze(transformers.AutoConfig.for_model("axk1"))
