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


ROTARY_LIST = """\
import copy

import torch
from torch import nn


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.inv_freq = nn.Buffer(torch.ones(4), persistent=False)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.mlp = nn.Linear(4, 4)
        # one rotary module per base
        self.rotary_embs = nn.ModuleList()
        for theta in sorted(set(config.layer_rope_theta)):
            theta_config = copy.deepcopy(config)
            theta_config.rope_theta = theta
            self.rotary_embs.append(LlamaRotaryEmbedding(theta_config))

    def forward(self, x):
        return self.mlp(x)
"""


def test_a_list_of_stateless_modules_nothing_reads_goes_with_the_loop_filling_it():
    # Granite-SWA's rotary embeddings per base: the rotary class then goes as unreachable
    # (the unused import goes when the file is formatted)
    after = rewrite(strip_hf_runtime, ROTARY_LIST, llama_like())
    assert "rotary_embs" not in after and "LlamaRotaryEmbedding" not in after and "theta" not in after
    assert "        super().__init__()\n        self.mlp = nn.Linear(4, 4)\n\n    def forward" in after


def test_the_list_stays_when_read_or_when_its_modules_hold_weights():
    read = ROTARY_LIST.replace("return self.mlp(x)", "return self.mlp(x) + len(self.rotary_embs)")
    assert "self.rotary_embs.append(LlamaRotaryEmbedding(theta_config))" in rewrite(
        strip_hf_runtime, read, llama_like()
    )
    weighted = ROTARY_LIST.replace(
        "self.inv_freq = nn.Buffer(torch.ones(4), persistent=False)", "self.proj = nn.Linear(4, 4)"
    )
    assert "self.rotary_embs.append(LlamaRotaryEmbedding(theta_config))" in rewrite(
        strip_hf_runtime, weighted, llama_like()
    )
