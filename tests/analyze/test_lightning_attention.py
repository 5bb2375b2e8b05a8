"""analyze/lightning_attention.py: a block is vLLM's MiniMaxText01LinearAttention only when its
formula, with the slopes vLLM gives the layer's index and the block's own norm epsilon,
replays it; the decay rates the block keeps as a buffer are found by what they do."""

from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

from hfrewrite.analyze.lightning_attention import NOT_LIGHTNING, analyze_lightning, vllm_slopes
from hfrewrite.analyze.mixers import analyze_mixer
from hfrewrite.analyze.plan import LightningPlan, NoMatch

LAYERS = 3


def _config(**changes) -> transformers.MiniMaxConfig:
    sizes = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "head_dim": 16,
        "num_hidden_layers": LAYERS,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    }
    return transformers.MiniMaxConfig(**{**sizes, **changes})


def _layer(config=None, index: int = 0) -> nn.Module:
    torch.manual_seed(0)
    block = MiniMaxLightningAttention(config or _config(), index)
    with torch.no_grad():  # past the init's small weights, so that the decay shows
        for param in block.parameters():
            param.normal_(0, 0.3)
    layer = nn.Module()
    layer.self_attn = block
    return layer


def test_minimaxs_lightning_attention_is_vllms():
    plan = analyze_lightning(_layer(), "self_attn", _config(), layer_idx=0)
    assert isinstance(plan, LightningPlan), plan
    assert (plan.module_class, plan.attr, plan.vllm_dtype) == (
        "MiniMaxLightningAttention",
        "self_attn",
        "float32",
    )
    # transformers' norm keeps 1e-6, vLLM's class builds 1e-5: the file's layer takes the block's
    assert plan.norm_eps == "1e-06"
    # the decay rates are the buffer that replays the block; the tables derived from them are skipped
    assert plan.rates == "slope_rate"
    assert set(plan.buffers) == {"slope_rate", "query_decay", "key_decay", "diagonal_decay"}
    assert dict(plan.checkpoint_suffix_renames) == {
        ".self_attn.query_decay": None,
        ".self_attn.key_decay": None,
        ".self_attn.diagonal_decay": None,
    }
    assert [condition for condition, _ in plan.fixed][1:] == [
        'getattr(config, "head_dim", None) is not None',
        'bin(config.num_attention_heads).count("1") == 1',
    ]
    assert isinstance(analyze_mixer(_layer(), "self_attn", _config(), 0), LightningPlan)


def test_the_slopes_of_another_layer_do_not_replay_the_block():
    """The block was built at index 0 (full decay rates); read as the layer at index 1,
    vLLM's slopes are half as steep, and the replay says so."""
    plan = analyze_lightning(_layer(index=0), "self_attn", _config(), layer_idx=1)
    assert isinstance(plan, NoMatch) and "at layer 1 differs by" in plan.reason, plan


def test_without_the_layers_index_nothing_is_proven():
    plan = analyze_lightning(_layer(), "self_attn", _config())
    assert isinstance(plan, NoMatch) and "index in the stack is not known" in plan.reason


def test_a_head_dim_vllm_would_not_read_is_refused():
    config = _config()
    layer = _layer(config)
    config.head_dim = None  # vLLM's class reads config.head_dim, the block derived its own
    plan = analyze_lightning(layer, "self_attn", config, layer_idx=0)
    assert isinstance(plan, NoMatch) and "config.head_dim (None)" in plan.reason, plan


def test_a_block_computing_otherwise_is_refused_by_the_replay():
    layer = _layer()
    layer.self_attn.act_fn = nn.Tanh()  # its q, k, v through another activation than vLLM's silu
    plan = analyze_lightning(layer, "self_attn", _config(), layer_idx=0)
    assert isinstance(plan, NoMatch) and "differs by" in plan.reason, plan


def test_vllms_slopes_for_a_power_of_two_are_alibis():
    assert torch.allclose(vllm_slopes(4, 0, LAYERS), torch.tensor([2**-2, 2**-4, 2**-6, 2**-8]) * (1 + 1e-5))
    assert torch.allclose(vllm_slopes(4, 2, LAYERS), torch.tensor([2**-2, 2**-4, 2**-6, 2**-8]) * 1e-5)


def test_other_blocks_are_no_lightning_attention():
    layer = nn.Module()
    layer.self_attn = nn.Linear(4, 4)
    assert analyze_lightning(layer, "self_attn", _config(), 0).reason == NOT_LIGHTNING
