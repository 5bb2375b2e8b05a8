"""GPT-Neo's form of hand-written attention: unscaled scores selected by a boolean buffer of
the module with ``torch.where``, the buffer a causal band for local layers. The fold proves
the window on the values and the whole buffer a band of it; a buffer that only looks like
one over the example's few positions, or a window not seen, does not fold."""

from __future__ import annotations

import torch
from torch import nn

from hfrewrite.analyze.attention_calls import AttentionCall
from hfrewrite.analyze.manual_attention import by_hand_facts, fold_manual_attention
from hfrewrite.analyze.mask_window import band, proven_band
from hfrewrite.analyze.trace import causal_sdpa, trace
from hfrewrite.emit.position_code import CAUSAL_WINDOW

B, H, S, D, POSITIONS = 2, 4, 5, 8, 16


class _BufferMasked(nn.Module):
    """q, k, v as [batch, heads, seq, dim]; scores masked by a slice of ``self.bias``."""

    def __init__(self, bias: torch.Tensor, scale: float | None = None) -> None:
        super().__init__()
        self.bias = nn.Buffer(bias.view(1, 1, POSITIONS, POSITIONS), persistent=False)
        self.scale = scale

    def forward(self, q, k, v):
        scores = torch.matmul(q, k.transpose(-1, -2))
        if self.scale is not None:
            scores = scores * self.scale
        length = q.size(-2)
        mask = self.bias[:, :, :length, :length]
        scores = torch.where(mask, scores, torch.tensor(torch.finfo(scores.dtype).min))
        return torch.matmul(torch.softmax(scores, dim=-1), v)


def _inputs():
    torch.manual_seed(0)
    return tuple(torch.randn(B, H, S, D) for _ in range(3))


def _folded(module):
    args = _inputs()
    traced = trace(module, args)
    folded = fold_manual_attention(traced)
    leaves = [n for n in traced.graph.nodes if n.target is causal_sdpa]
    if folded:
        torch.testing.assert_close(traced.graph_module(*args), module(*args), rtol=1e-5, atol=1e-5)
    return folded, leaves


def test_a_local_band_buffer_folds_with_its_window_and_scale_one():
    folded, (leaf,) = _folded(_BufferMasked(band(POSITIONS, 3)))
    assert folded == 1
    assert leaf.kwargs["sliding_window"] == 3 and leaf.kwargs["scaling"] == 1.0
    assert by_hand_facts(leaf, "") == {
        "window_mask": "bias",
        "attention_call": AttentionCall.CAUSAL_SDPA_UNSCALED,
    }


def test_a_global_tril_buffer_folds_without_a_window_and_names_the_buffer():
    folded, (leaf,) = _folded(_BufferMasked(band(POSITIONS, None), scale=D**-0.5))
    assert folded == 1
    assert leaf.kwargs["sliding_window"] is None and leaf.kwargs["scaling"] is None
    assert by_hand_facts(leaf, "") == {"window_mask": "bias", "attention_call": AttentionCall.CAUSAL_SDPA}


def test_a_buffer_that_is_a_band_only_over_the_example_does_not_fold():
    bias = band(POSITIONS, None).clone()
    bias[10, 2] = False  # past the 5 positions the example reads: the file would be wrong there
    folded, _ = _folded(_BufferMasked(bias))
    assert folded == 0


def test_a_window_wider_than_the_example_does_not_fold():
    # causal over 5 tokens, a band of 8 over the buffer: the window is never seen
    folded, _ = _folded(_BufferMasked(band(POSITIONS, 8)))
    assert folded == 0


def test_proven_band_reads_the_whole_buffer():
    assert proven_band(band(POSITIONS, 4).view(1, 1, POSITIONS, POSITIONS), 4)
    assert not proven_band(band(POSITIONS, 4), 3)
    assert not proven_band(band(POSITIONS, 4).float(), 4)  # a boolean mask only


def test_the_files_causal_window_reads_the_band_and_refuses_anything_else():
    namespace = {"torch": torch}
    exec(CAUSAL_WINDOW, namespace)  # noqa: S102  (the helper as the generated file holds it)
    causal_window = namespace["causal_window"]
    assert causal_window(band(64, 8).view(1, 1, 64, 64)) == 8
    assert causal_window(band(64, None)) is None
    odd = band(64, None).clone()
    odd[40, 3] = False
    try:
        causal_window(odd)
    except ValueError as exc:
        assert "not a causal band" in str(exc)
    else:
        raise AssertionError("a mask that is no band was read as a window")


def test_the_shrunk_gpt_neo_config_sees_its_window_and_reloads():
    """The window (256) is cut to one the 5-token example run sees; the per-layer pattern
    (``attention_types``) and its expansion are cut to the shrunk layer count, so the saved
    config loads again (its class checks the two agree)."""
    import transformers

    from hfrewrite.analyze.shrink import shrink_config

    config = transformers.GPTNeoConfig()
    small = shrink_config(config)
    assert small.window_size < S and small.num_hidden_layers == 2
    assert small.attention_layers == ["global", "local"]
    assert small.attention_types == [[["global", "local"], 1]]
    reloaded = transformers.GPTNeoConfig.from_dict(small.to_dict())
    assert reloaded.attention_layers == ["global", "local"] and reloaded.window_size == small.window_size


def test_a_one_layer_gpt_neo_config_is_extended_to_the_shrunk_layer_count():
    """A config with fewer layers than the shrink keeps (one local layer) has its per-layer
    pattern extended with it: the shrunk model builds (it raised IndexError)."""
    import transformers

    from hfrewrite.analyze.shrink import shrink_config

    config = transformers.GPTNeoConfig(num_layers=1, attention_types=[[["local"], 1]], window_size=4)
    small = shrink_config(config)
    assert small.num_hidden_layers == 2
    assert small.attention_layers == ["local", "local"] and small.attention_types == [[["local"], 2]]
    small._attn_implementation = "eager"
    transformers.AutoModelForCausalLM.from_config(small)  # every layer finds its kind
