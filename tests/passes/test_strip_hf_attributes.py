"""strip_hf_runtime's attribute pruning: what an attention kept for the code vLLM's layers
replaced (dropout rates and modules, scales, a config field read through ``self.config``)
goes; a submodule built from a class holding vLLM layers stays, even unread."""

from harness import assert_rewrites, rewrite
from hfrewrite.passes import strip_hf_runtime
from plans import llama_like

BEFORE = """\
import math

import torch
from torch import nn


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        self.attention_dropout = self.config.attention_dropout
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        # the scores' scale
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.attn = Attention(config.num_attention_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions, hidden_states):
        return self.attn(hidden_states, hidden_states, hidden_states)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.self_attn = LlamaAttention(config)
        if config.add_cross_attention:
            self.crossattention = LlamaAttention(config)

    def forward(self, positions, hidden_states):
        return self.self_attn(positions, hidden_states) * self.config.hidden_size
"""

# self.config goes too, once the one statement reading it is gone; the cross-attention is
# never read but LlamaAttention builds vLLM's Attention: dropping it would drop weights
AFTER = BEFORE.replace(
    """        self.config = config
        self.head_dim = config.head_dim
        self.attention_dropout = self.config.attention_dropout
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        # the scores' scale
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
""",
    "        self.head_dim = config.head_dim\n",
)


def test_unread_rates_scales_and_dropouts_go():
    assert AFTER != BEFORE
    assert_rewrites(strip_hf_runtime, BEFORE, AFTER, llama_like())


def test_an_attribute_read_by_the_forward_stays():
    source = BEFORE.replace(
        "        return self.attn(hidden_states, hidden_states, hidden_states)\n",
        "        return self.attn(hidden_states, hidden_states, hidden_states) * self.inv_norm_factor\n",
    )
    assert "self.inv_norm_factor = 1.0" in rewrite(strip_hf_runtime, source, llama_like())


def test_a_module_of_a_class_without_layers_goes_unread():
    # the same cross-attention, built from a class that holds no layer: nothing to load
    source = BEFORE.replace(
        "        self.attn = Attention(config.num_attention_heads, self.head_dim, self.head_dim**-0.5)\n",
        "",
    ).replace("return self.attn(hidden_states, hidden_states, hidden_states)", "return hidden_states")
    assert "self.crossattention" not in rewrite(strip_hf_runtime, source, llama_like())
