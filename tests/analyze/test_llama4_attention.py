"""Llama-4's text attention, on the installed transformers' own classes: its rope (complex
multiplication, GPT-J's interleaved pairs) is proven through the weightless q/k norm that
follows it and the transpose after that (analyze/attention.py, analyze/rope.py); its chunked
local attention, which a short example run would see as causal, is seen on the mask the
shrunk config's chunks give (analyze/shrink.py) and checked against the config's chunk size
and layer types (analyze/chunked_layers.py); its NoPE layers have no q/k norm (the file keeps
the source's test) and a per-token temperature computed from positions the forward makes
itself, proven by replay on far positions (analyze/position_function.py). Its MoE layers:
tests/analyze/test_llama4_moe.py."""

import pytest
import torch
import transformers

from hfrewrite.analyze.attention_options import chunked_band
from hfrewrite.analyze.head_layout import norm_through_layout
from hfrewrite.analyze.mask_window import band
from hfrewrite.analyze.model import analyze
from hfrewrite.analyze.norm_kinds import QkNormOrder
from hfrewrite.analyze.rope_styles import RopeStyle
from hfrewrite.analyze.shrink import shrink_config
from hfrewrite.analyze.trace import trace
from hfrewrite.errors import HfrewriteError


def _config(**changes):
    config = transformers.AutoConfig.for_model("llama4_text")
    layers = config.num_hidden_layers
    # dense layers alone (moe_layers: [])
    defaults = {"no_rope_layers": [1] * layers, "layer_types": ["full_attention"] * layers, "moe_layers": []}
    for name, value in {**defaults, **changes}.items():
        setattr(config, name, value)
    return config


def test_the_rope_is_proven_gptj_before_the_norm_that_follows_it():
    attention = analyze(_config()).attention
    assert attention.rope_style is RopeStyle.GPTJ
    assert attention.rotary_dim == attention.head_dim
    assert attention.qk_norm_order is QkNormOrder.AFTER_ROPE
    assert (attention.q_norm, attention.k_norm, attention.qk_norm_over) == ("qk_norm", "qk_norm", "head")


def test_the_shrink_makes_attention_chunks_shorter_than_the_example_run():
    assert shrink_config(_config()).attention_chunk_size == 3


def test_chunked_layers_are_those_the_config_names_at_its_chunk_size():
    chunked = _config(layer_types=["chunked_attention", "full_attention"] * 24)
    assert analyze(chunked).attention.attention_chunk == 3  # the shrunk chunk


def test_chunked_masks_on_layers_the_config_does_not_name_are_refused(monkeypatch):
    from hfrewrite.analyze import chunked_layers

    monkeypatch.setattr(
        chunked_layers, "CHUNKED", "sliding_attention"
    )  # the layers' masks are read as unnamed
    chunked = _config(layer_types=["chunked_attention"] * 48)
    with pytest.raises(HfrewriteError, match="the chunked layers are not those config.layer_types names"):
        analyze(chunked)


def test_a_nope_layers_temperature_is_the_forwards_expression_of_its_positions():
    nope = _config(no_rope_layers=[1, 0] * 24, attn_temperature_tuning=True)
    attention = analyze(nope).attention
    line, expression, positions = attention.q_position_scale
    assert line == "query_states = (query_states * attn_scales).to(query_states.dtype)"
    assert (
        expression
        == "torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0"
    )
    assert positions == "positions"
    assert attention.qk_norm_layers_some  # NoPE layers build no qk_norm


def test_a_temperature_expression_that_differs_from_the_graph_far_out_is_refused(monkeypatch):
    # The replay runs the traced steps and the expression on positions far beyond the
    # example's: an expression equal to the graph on 0..seq-1 alone does not pass
    from hfrewrite.analyze import position_function

    real = position_function.ast.unparse
    monkeypatch.setattr(
        position_function.ast, "unparse", lambda node: real(node).replace("floor_scale", "attn_scale")
    )
    nope = _config(no_rope_layers=[1, 0] * 24, attn_temperature_tuning=True)
    with pytest.raises(HfrewriteError, match="a position-dependent op is applied to q alone"):
        analyze(nope)


def test_a_windowed_band_is_what_a_sliding_call_may_be_handed():
    causal = band(5, None)
    assert torch.equal(band(5, 8), causal)
    assert not band(5, 3)[4, 1] and band(5, 3)[4, 2]


def test_a_chunked_band_sees_its_own_chunk_alone():
    chunks = chunked_band(5, 3)
    assert chunks[2, 0] and not chunks[3, 2] and chunks[4, 3]
    assert torch.equal(chunked_band(5, 5), band(5, None))


class _L2Norm(torch.nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _NormThen(torch.nn.Module):
    def __init__(self, relayout):
        super().__init__()
        self.qk_norm, self.relayout = _L2Norm(), relayout

    def forward(self, x):  # [batch, seq, heads, head_dim]
        return self.relayout(self.qk_norm(x))


@pytest.mark.parametrize(
    ("relayout", "found"),
    [
        (lambda y: y, True),
        (lambda y: y.transpose(1, 2), True),
        (lambda y: y.transpose(1, 2).contiguous(), True),
        # heads regrouped: the lanes move, the rope proven before it would not be the file's
        (lambda y: y.reshape(y.shape[0], y.shape[1], 2, -1).transpose(1, 2), False),
    ],
)
def test_a_norm_after_the_rope_is_found_through_layout_that_moves_no_lane(relayout, found):
    traced = trace(_NormThen(relayout), (torch.randn(2, 5, 4, 8),))
    (out,) = [n for n in traced.graph.nodes if n.op == "output"]
    norm = norm_through_layout(out.args[0], traced)
    assert (norm is not None and norm.target == "qk_norm") is found
