"""Llama-4's text attention, on the installed transformers' own classes: its rope (complex
multiplication, GPT-J's interleaved pairs) is proven through the weightless q/k norm that
follows it and the transpose after that (analyze/attention.py, analyze/rope.py); its chunked
local attention, which a short example run would see as causal, is seen on the mask the
shrunk config's chunks give (analyze/shrink.py) and refused (analyze/attention_options.py);
its NoPE layers' per-token temperature, computed from the sequence length rather than the
positions the layer is given, is refused."""

import pytest
import torch
import transformers

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
    defaults = {"no_rope_layers": [1] * layers, "layer_types": ["full_attention"] * layers}
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


def test_chunked_attention_is_refused_for_its_mask():
    chunked = _config(layer_types=["chunked_attention"] * 48)
    with pytest.raises(HfrewriteError, match="the mask the attention call is given is not causal"):
        analyze(chunked)


def test_the_released_config_is_refused_for_its_chunked_layers():
    with pytest.raises(HfrewriteError) as refused:
        analyze(transformers.AutoConfig.for_model("llama4_text"))
    assert "Llama4TextAttention: vllm_attention: the mask the attention call is given is not causal" in str(
        refused.value
    )


def test_a_nope_layers_temperature_of_the_sequence_length_is_refused():
    # q alone is scaled by a factor of torch.arange(seq) + the cache's length, not of the
    # positions the layer is given: no vLLM position feeds it
    nope = _config(no_rope_layers=[1, 0] * 24, attn_temperature_tuning=True)
    with pytest.raises(
        HfrewriteError,
        match="a position-dependent op is applied to q alone, and not as a per-token factor of the positions",
    ):
        analyze(nope)


def test_a_windowed_band_is_what_a_sliding_call_may_be_handed():
    causal = band(5, None)
    assert torch.equal(band(5, 8), causal)
    assert not band(5, 3)[4, 1] and band(5, 3)[4, 2]


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
