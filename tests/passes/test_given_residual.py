"""An attention block that adds the layer's residual to its output projection (BLOOM's
``dropout_add(out, residual)``; the analysis proved ``adds_residual``): the vLLM forward
takes the residual and returns the projection plus it, and the carried layer passes it."""

import dataclasses

import pytest
from harness import rewrite
from hfrewrite.passes import carry_decoder_layer, vllm_attention
from plans import llama_like

from hfrewrite.analyze.plan import DecoderLayerPlan
from hfrewrite.errors import HfrewriteError

ATTENTION = """\
class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.scaling = self.head_dim**-0.5

    def forward(self, hidden_states, residual, position_embeddings, attention_mask, **kwargs):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_states = q.view(hidden_shape).transpose(1, 2)
        key_states = k.view(hidden_shape).transpose(1, 2)
        value_states = v.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask, scaling=self.scaling, **kwargs
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        attn_output = dropout_add(attn_output, residual, self.hidden_dropout, self.training)
        return attn_output, attn_weights
"""

LAYER = """
class LlamaDecoderLayer(nn.Module):
    def forward(self, hidden_states, attention_mask=None, **kwargs):
        normed = self.input_layernorm(hidden_states)
        out, weights = self.self_attn(normed, hidden_states, attention_mask=attention_mask)
        return self.mlp(self.post_attention_layernorm(out)) + out, weights
"""


def plan():
    base = llama_like()
    layer = DecoderLayerPlan("LlamaDecoderLayer", (), returns_tuple=True)
    return dataclasses.replace(
        base, decoder_layer=layer, attention=dataclasses.replace(base.attention, adds_residual=True)
    )


def test_the_attention_takes_and_adds_the_residual():
    out = rewrite(vllm_attention, ATTENTION, plan())
    want = (
        "    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor)"
        " -> torch.Tensor:\n"
        "        qkv, _ = self.qkv_proj(hidden_states)\n"
        "        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)\n"
        "        q, k = self.rotary_emb(positions, q, k)\n"
        "        attn_output = self.attn(q, k, v)\n"
        "        attn_output = self.o_proj(attn_output)\n"
        "        return attn_output + residual\n"
    )
    assert want in out, out


def test_the_carried_layer_passes_the_residual_and_returns_its_hidden_states():
    out = rewrite(carry_decoder_layer, ATTENTION + LAYER, plan())
    assert "out = self.self_attn(positions=positions, hidden_states=normed, residual=hidden_states)\n" in out
    assert "return self.mlp(self.post_attention_layernorm(out)) + out\n" in out  # weights left out


def test_two_tensors_read_after_the_projection_are_refused():
    source = ATTENTION.replace("self.hidden_dropout, self.training)", "attention_mask, self.training)")
    with pytest.raises(HfrewriteError, match="not one parameter of forward"):
        rewrite(vllm_attention, source, plan())
