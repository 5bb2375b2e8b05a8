"""The rope tables the analysis replays are vLLM's own: each replica against vLLM's class."""

import pytest
import torch

from hfrewrite.analyze.rope import apply_rope, deepseek_yarn
from hfrewrite.analyze.rope_styles import RopeStyle

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}


@pytest.mark.vllm
@pytest.mark.parametrize(
    "params",
    [
        YARN,
        {
            **YARN,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "factor": 4.0,
            "rope_theta": 1e6,
        },  # DeepSeek-V2's
        {
            k: v for k, v in YARN.items() if k not in ("mscale", "mscale_all_dim", "beta_fast")
        },  # vLLM's defaults
    ],
)
def test_deepseek_yarn_replica_equals_vllms_table(params):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (
        DeepseekScalingRotaryEmbedding,
    )

    rotary = 64
    extra = {k: params[k] for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim") if k in params}
    with set_current_vllm_config(VllmConfig()):
        vllm_rope = DeepseekScalingRotaryEmbedding(
            rotary,
            rotary,
            params["original_max_position_embeddings"],
            params["rope_theta"],
            True,
            params["factor"],
            torch.float32,
            **extra,
        )
    inv_freq, scale = deepseek_yarn(params, rotary)
    torch.testing.assert_close(
        inv_freq.float(),
        vllm_rope._compute_inv_freq(params["factor"]),
        atol=0,
        rtol=1e-6,
    )
    assert scale == pytest.approx(vllm_rope.mscale, rel=1e-12)
    # the table at the positions a short prompt uses (far positions differ by float32 angle rounding)
    positions = torch.arange(64)
    cos, sin = vllm_rope.cos_sin_cache[positions].double().chunk(2, dim=-1)
    x = torch.randn(len(positions), rotary, dtype=torch.float64)
    rotated = apply_rope(x, positions, inv_freq, scale, RopeStyle.NEOX)
    x1, x2 = x.chunk(2, dim=-1)
    want = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    torch.testing.assert_close(rotated, want, atol=1e-5, rtol=1e-5)


def test_deepseek_yarn_refuses_what_vllm_cannot_take():
    assert "needs factor" in deepseek_yarn({**YARN, "factor": None}, 64)
    assert "None" in deepseek_yarn({**YARN, "mscale": None}, 64)
