"""A carried layer's branch no traced layer took, that reads inputs vLLM does not give
(Granite-4.0's Mamba call in a model whose layers all attend): the forward keeps the branch
every layer took, ``__init__`` no longer builds the other's part and refuses the configs that
would take it; ``config_guards`` adds no second guard."""

import dataclasses

from harness import apply, rewrite
from hfrewrite.passes import carry_decoder_layer, config_guards
from plans import llama_like

from hfrewrite.analyze.plan import DecoderLayerPlan

TEST = "config.layers_block_type[layer_idx] == 'linear_attention'"


def plan(value: bool = False):
    base = llama_like("G", "granitemoehybrid")
    layer = DecoderLayerPlan("Layer", (), attention_block="self_attn")
    return dataclasses.replace(
        base,
        decoder_layer=layer,
        attention=dataclasses.replace(base.attention, module_class="Attention"),
        forward_switches=(("Layer", TEST, value),),
    )


SOURCE = """\
class Attention(nn.Module):
    def forward(self, hidden_states, position_embeddings, **kwargs):
        return hidden_states, None


class Layer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = None
        self.mamba = None
        if config.layers_block_type[layer_idx] == "linear_attention":
            self.mamba = Mamba(config, layer_idx)
        else:
            self.self_attn = Attention(config)

    def forward(self, hidden_states, past_key_values=None, position_embeddings=None, **kwargs):
        residual = hidden_states
        if self.mamba is not None:
            hidden_states = self.mamba(hidden_states, cache_params=past_key_values, **kwargs)
        else:
            hidden_states, _ = self.self_attn(hidden_states, position_embeddings, **kwargs)
        return residual + hidden_states
"""


def test_the_branch_no_layer_took_goes_and_init_refuses_it():
    out = rewrite(carry_decoder_layer, SOURCE, plan())
    assert "self.mamba(" not in out and "Mamba(" not in out  # (strip_hf_runtime drops `= None`)
    assert "hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)" in out
    assert f"if ({TEST}):\n            raise NotImplementedError" in out
    assert rewrite(config_guards, out, plan()) == out  # the guard is there: none added
    rows = [row for row in apply(carry_decoder_layer, SOURCE, plan()).fused if "config switch" in str(row)]
    assert len(rows) == 1 and TEST in str(rows[0])  # --explain says which branch was kept


def test_a_branch_every_layer_took_stays_when_the_other_reads_nothing_dropped():
    source = SOURCE.replace(
        "self.mamba(hidden_states, cache_params=past_key_values, **kwargs)", "-hidden_states"
    )
    out = rewrite(carry_decoder_layer, source, plan())
    assert "if self.mamba is not None:" in out and "raise" not in out


ERNIE_LIKE = """\
class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.shared = None
        if config.shared > 0:
            self.shared = Mlp(config)
        self.experts = FusedMoE(shared_experts=self.shared)

    def forward(self, x):
        return self.experts(x)
"""


def test_a_part_the_class_still_reads_carries_its_switch():
    """ERNIE's shared experts, handed to vLLM's MoE None or not: no guard; a part nothing
    reads any more carries nothing: guarded."""
    shared = dataclasses.replace(plan(), forward_switches=(("Block", "config.shared > 0", True),))
    assert rewrite(config_guards, ERNIE_LIKE, shared) == ERNIE_LIKE
    unread = ERNIE_LIKE.replace("FusedMoE(shared_experts=self.shared)", "FusedMoE()")
    assert "if not (config.shared > 0):\n            raise" in rewrite(config_guards, unread, shared)


def test_a_none_the_taken_branch_now_overwrites_goes_unless_read_first():
    out = rewrite(carry_decoder_layer, SOURCE, plan())
    assert out.count("self.self_attn =") == 1 and "self.mamba = None" in out  # (never built again)
    read_first = SOURCE.replace(
        "        self.mamba = None\n", "        self.mamba = None\n        self.kind = self.self_attn\n"
    )
    assert rewrite(carry_decoder_layer, read_first, plan()).count("self.self_attn = None") == 1
