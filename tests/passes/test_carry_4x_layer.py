"""A transformers 4.x decoder layer carried into vLLM's calling convention: its flags take
their defaults (vLLM does not pass them), branches on them reduce to the branch taken, the
attention's tuple becomes a one-tuple, and the layer's output tuple gives its first element."""

import dataclasses

import libcst as cst
import pytest
from harness import assert_rewrites, rewrite
from hfrewrite.passes import carry_decoder_layer
from plans import llama_like

from hfrewrite.analyze.plan import DecoderLayerPlan
from hfrewrite.emit.dropped_defaults import bound_to_defaults
from hfrewrite.errors import HfrewriteError


def plan(returns_tuple: bool = True):
    base = llama_like("RW", "falcon_rw")
    layer = DecoderLayerPlan(
        "DecoderLayer",
        (),
        attention_block="self_attention",
        returns_tuple=returns_tuple,
        free_defaults=("layer_past", "output_attentions", "use_cache"),
    )
    return dataclasses.replace(
        base, decoder_layer=layer, attention=dataclasses.replace(base.attention, module_class="Attention")
    )


ATTENTION = """\
class Attention(nn.Module):
    def forward(self, hidden_states, alibi, attention_mask, layer_past=None, use_cache=False):
        return hidden_states, None

"""

BEFORE = (
    ATTENTION
    + """
class DecoderLayer(nn.Module):
    def forward(self, hidden_states, alibi, attention_mask, layer_past=None, use_cache=False, output_attentions=False):
        layernorm_output = self.input_layernorm(hidden_states)
        residual = hidden_states
        attn_outputs = self.self_attention(
            layernorm_output, layer_past=layer_past, attention_mask=attention_mask, alibi=alibi, use_cache=use_cache
        )
        attention_output = attn_outputs[0]
        residual = attention_output + residual
        outputs = attn_outputs[1:]
        output = self.mlp(self.post_attention_layernorm(residual)) + residual
        if use_cache:
            outputs = (output,) + outputs
        else:
            outputs = (output,) + outputs[1:]
        return outputs  # hidden_states, present, attentions
"""
)

AFTER = (
    ATTENTION
    + """
class DecoderLayer(nn.Module):
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        layernorm_output = self.input_layernorm(hidden_states)
        residual = hidden_states
        attn_outputs = (self.self_attention(positions=positions, hidden_states=layernorm_output),)
        attention_output = attn_outputs[0]
        residual = attention_output + residual
        outputs = attn_outputs[1:]
        output = self.mlp(self.post_attention_layernorm(residual)) + residual
        outputs = (output,) + outputs[1:]
        return outputs[0]  # hidden_states, present, attentions
"""
)


def test_4x_layer_is_carried_into_vllms_convention():
    assert_rewrites(carry_decoder_layer, BEFORE, AFTER, plan())


def test_layer_returning_its_tensor_keeps_its_return():
    source = BEFORE.replace("        return outputs  #", "        return outputs[0]  #")
    assert "return outputs[0][0]" not in rewrite(carry_decoder_layer, source, plan(returns_tuple=False))


def _reduced(src: str, dropped: set[str]) -> tuple[str, set[str]]:
    fn = cst.parse_module(src).body[0]
    body, bound = bound_to_defaults(fn, dropped)
    return cst.Module([fn.with_changes(body=body)]).code, bound


@pytest.mark.parametrize(
    ("src", "want"),
    [
        # elif chains: the first literal test that holds decides
        (
            (
                "def f(x, a=False, b=None):\n    if a:\n        x = 1\n    elif b is None:\n        x = 2\n"
                "    else:\n        x = 3\n    return x\n"
            ),
            "def f(x, a=False, b=None):\n    x = 2\n    return x\n",
        ),
        # a test not made of literals stays; its literal elif reduces to an else
        (
            "def f(x, a=False):\n    if x:\n        x = 1\n    elif not a:\n        x = 2\n    return x\n",
            "def f(x, a=False):\n    if x:\n        x = 1\n    else:\n        x = 2\n    return x\n",
        ),
        # nothing left in a block: pass
        (
            "def f(x, a=False):\n    if x:\n        if a:\n            x = 1\n    return x\n",
            "def f(x, a=False):\n    if x:\n        pass\n    return x\n",
        ),
    ],
)
def test_flags_take_their_defaults(src, want):
    assert _reduced(src, {"a", "b"})[0] == want


def test_rebound_or_computed_defaults_are_left_alone():
    src = "def f(x, a=False, c=max(1, 2)):\n    a = a or x\n    if a:\n        x = c\n    return x\n"
    assert _reduced(src, {"a", "c"}) == (src, set())


def test_inputs_not_proven_free_stay_dropped_and_refused():
    layer = dataclasses.replace(plan().decoder_layer, free_defaults=())
    with pytest.raises(HfrewriteError, match="reads use_cache"):
        rewrite(carry_decoder_layer, BEFORE, dataclasses.replace(plan(), decoder_layer=layer))


HANDING_UP_BEFORE = """\
class SelfAttention(nn.Module):
    def forward(self, hidden_states, attention_mask=None, layer_past=None):
        return hidden_states, None


class AttentionWrapper(nn.Module):
    def forward(self, hidden_states, layer_past=None, attention_mask=None):
        return self.attention(hidden_states, attention_mask=attention_mask, layer_past=layer_past)


class Block(nn.Module):
    def forward(self, hidden_states, layer_past=None, attention_mask=None):
        residual = hidden_states
        attn_output, attn_weights = self.attn(self.ln_1(hidden_states), layer_past=layer_past, attention_mask=attention_mask)
        hidden_states = attn_output + residual
        return hidden_states, attn_weights
"""

HANDING_UP_AFTER = """\
class SelfAttention(nn.Module):
    def forward(self, hidden_states, attention_mask=None, layer_past=None):
        return hidden_states, None


class AttentionWrapper(nn.Module):
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor):
        return self.attention(positions=positions, hidden_states=hidden_states)


class Block(nn.Module):
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        attn_output = self.attn(positions=positions, hidden_states=self.ln_1(hidden_states))
        hidden_states = attn_output + residual
        return hidden_states
"""


def test_a_wrapper_handing_the_attention_tuple_up_returns_vllms_tensor():
    """GPT-Neo's GPTNeoAttention returns its attention's (output, weights) as it is: it
    returns vLLM's tensor, and the block takes that as it took the tuple's first element."""
    base = llama_like()
    layer = DecoderLayerPlan(
        "Block",
        (),
        attention_block="attn.attention",
        attention_wrappers=("AttentionWrapper",),
        returns_tuple=True,
    )
    wrapped = dataclasses.replace(
        base, decoder_layer=layer, attention=dataclasses.replace(base.attention, module_class="SelfAttention")
    )
    assert_rewrites(carry_decoder_layer, HANDING_UP_BEFORE, HANDING_UP_AFTER, wrapped)


RETURNED_BEFORE = """\
class Attention(nn.Module):
    def forward(self, hidden_states, attention_mask=None):
        return self.dense(hidden_states), None, self.dense_bias


class Layer(nn.Module):
    def forward(self, hidden_states, attention_mask=None):
        attn_output, attn_weights, attn_bias = self.attention(self.ln(hidden_states), attention_mask=attention_mask)
        if attn_bias is not None:
            attn_output = attn_output + attn_bias
        return attn_output + hidden_states
"""

RETURNED_AFTER = """\
class Attention(nn.Module):
    def forward(self, hidden_states, attention_mask=None):
        return self.dense(hidden_states), None, self.dense_bias


class Layer(nn.Module):
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        attn_output, attn_bias = self.attention(positions=positions, hidden_states=self.ln(hidden_states)), self.attention.dense_bias
        if attn_bias is not None:
            attn_output = attn_output + attn_bias
        return attn_output + hidden_states
"""


def _returning(returned: tuple[str, ...]):
    base = llama_like()
    layer = DecoderLayerPlan("Layer", (), attention_block="attention")
    attention = dataclasses.replace(base.attention, module_class="Attention", returned_parameters=returned)
    return dataclasses.replace(base, decoder_layer=layer, attention=attention)


def test_a_parameter_the_attention_returns_is_read_off_it():
    """GPT-NeoX-Japanese's attention returns its dense_bias for the layer to add (the
    analysis proved that output is the block's own parameter): the layer reads it off the
    block, and the attention weights beside it still go unread."""
    assert_rewrites(carry_decoder_layer, RETURNED_BEFORE, RETURNED_AFTER, _returning(("dense_bias",)))


def test_an_extra_output_not_proven_a_parameter_stays_refused():
    with pytest.raises(HfrewriteError, match="the forward reads attn_bias, which vLLM does not give"):
        rewrite(carry_decoder_layer, RETURNED_BEFORE, _returning(()))
