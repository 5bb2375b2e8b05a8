"""Custom code that calls torch's scaled_dot_product_attention itself (not transformers'
attention interface): the call is the attention when the trace proves it causal
self-attention (is_causal=True or a constant causal mask, no dropout, torch's default
scale, a GQA expansion kv head ``h // groups`` for query head ``h``); each one-line change
that breaks one of those is refused, never converted."""

import shutil
from pathlib import Path

import pytest
import transformers

from hfrewrite.analyze import model as analysis
from hfrewrite.analyze.attention_calls import AttentionCall
from hfrewrite.analyze.qkv_layouts import QkvLayout
from hfrewrite.analyze.rope_styles import RopeLayers, RopeStyle
from hfrewrite.errors import HfrewriteError
from tests.analyze.by_hand import BY_HAND, BY_HAND_FLAT, attention_by_hand

DATA = Path(__file__).resolve().parents[1] / "data" / "custom_code"
SDPA = "calls torch's scaled_dot_product_attention directly"


def _analyze(tmp_path, monkeypatch, name: str, old: str = "", new: str = ""):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # a directory name of its own: transformers imports a repository's code once per name
    repo = shutil.copytree(DATA / name, tmp_path / f"{name}_{tmp_path.name}")
    if old:
        source = repo / f"modeling_{name}.py"
        text = source.read_text()
        assert text.count(old) == 1, old
        source.write_text(text.replace(old, new))
    config = transformers.AutoConfig.from_pretrained(repo, trust_remote_code=True)
    return analysis.analyze(config)


def test_causal_sdpa_in_a_helper_is_the_attention(tmp_path, monkeypatch):
    plan = _analyze(tmp_path, monkeypatch, "tinyllama_renamed")
    att = plan.attention
    assert att.attention_call is AttentionCall.CAUSAL_SDPA and (
        att.num_heads,
        att.num_kv_heads,
        att.head_dim,
    ) == (4, 2, 32)
    assert att.rope_layers is RopeLayers.ALL and att.rope_style is RopeStyle.NEOX
    # the helpers and calls the rewrite may drop, each proven to compute only what the plan holds
    for call in ("causal_attention", "rope_cos_sin", "rotate_half", "repeat_interleave"):
        assert call in att.replaced_calls


def test_constant_causal_mask_is_the_attention(tmp_path, monkeypatch):
    plan = _analyze(tmp_path, monkeypatch, "fusedqkv_postnorm")
    assert (
        plan.attention.attention_call is AttentionCall.CAUSAL_SDPA
        and plan.attention.qkv_layout is QkvLayout.BLOCKS
    )


@pytest.mark.parametrize(
    ("name", "old", "new", "reason"),
    [
        # bidirectional: not what vLLM's decoder attention computes
        ("tinyllama_renamed", "(q, k, v, is_causal=True)", "(q, k, v, is_causal=False)", SDPA),
        ("tinyllama_renamed", "(q, k, v, is_causal=True)", "(q, k, v, is_causal=True, dropout_p=0.1)", SDPA),
        (
            "tinyllama_renamed",
            "(q, k, v, is_causal=True)",
            "(q, k, v, is_causal=True, scale=0.1)",
            "explicit scale",
        ),
        # one future token visible
        ("fusedqkv_postnorm", ".tril(diagonal=s - t)", ".tril(diagonal=s - t + 1)", SDPA),
        # a mask read from the input (padding-like): not a constant
        ("fusedqkv_postnorm", ".tril(diagonal=s - t)", ".tril(diagonal=s - t) & (x[0, :, :1] > -1e9)", SDPA),
        # kv heads tiled (h % groups), not grouped (h // groups): vLLM's GQA would differ
        (
            "tinyllama_renamed",
            "k.repeat_interleave(rep, dim=1)\n        v = v.repeat_interleave(rep, dim=1)",
            "k.repeat(1, rep, 1, 1)\n        v = v.repeat(1, rep, 1, 1)",
            "heads",
        ),
        # k tiled, v grouped: no one kv layout
        ("tinyllama_renamed", "k.repeat_interleave(rep, dim=1)", "k.repeat(1, rep, 1, 1)", SDPA),
    ],
)
def test_what_is_not_causal_self_attention_is_refused(tmp_path, monkeypatch, name, old, new, reason):
    with pytest.raises(HfrewriteError, match=reason):
        _analyze(tmp_path, monkeypatch, name, old, new)


def _by_hand(tmp_path, monkeypatch, old: str = "", new: str = "", more: tuple = ()):
    """The analysis of tinyllama_renamed with attention by hand, ``old`` -> ``new`` and each
    ``(old, new)`` of ``more`` applied, each found once."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = shutil.copytree(DATA / "tinyllama_renamed", tmp_path / f"byhand_{tmp_path.name}")
    source = repo / "modeling_tinyllama_renamed.py"
    text = attention_by_hand(source.read_text())
    for before, after in ((old, new), *more) if old else more:
        assert text.count(before) == 1, before
        text = text.replace(before, after)
    source.write_text(text)
    return analysis.analyze(transformers.AutoConfig.from_pretrained(repo, trust_remote_code=True))


def test_attention_written_by_hand_is_proven_causal(tmp_path, monkeypatch):
    att = _by_hand(tmp_path, monkeypatch).attention
    assert att.attention_call is AttentionCall.CAUSAL_SDPA and (att.num_heads, att.num_kv_heads) == (4, 2)
    assert {"causal_attention", "repeat_interleave"} <= set(att.replaced_calls)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('    scores = scores.masked_fill(future, float("-inf"))\n', ""),  # bidirectional
        ("/ math.sqrt(q.shape[-1])", "/ q.shape[-1]"),  # another scale
        ("diagonal=s - t + 1", "diagonal=s - t + 2"),  # one future token visible
    ],
)
def test_attention_by_hand_that_is_not_causal_sdpa_is_refused(tmp_path, monkeypatch, old, new):
    with pytest.raises(
        HfrewriteError, match="SelfAttention: vllm_attention: computes a softmax attention by hand"
    ):
        _by_hand(tmp_path, monkeypatch, old, new)


def test_attention_by_hand_over_flattened_heads_is_proven_causal(tmp_path, monkeypatch):
    """[batch * heads, seq, dim] operands, scores viewed as [batch, heads, seq, seq]."""
    att = _by_hand(tmp_path, monkeypatch, BY_HAND, BY_HAND_FLAT).attention
    assert att.attention_call is AttentionCall.CAUSAL_SDPA and (att.num_heads, att.num_kv_heads) == (4, 2)


def test_attention_by_hand_over_flattened_heads_with_another_scale_is_refused(tmp_path, monkeypatch):
    flat = BY_HAND_FLAT.replace("/ math.sqrt(q.shape[-1])", "/ q.shape[-1]")
    with pytest.raises(HfrewriteError, match="computes a softmax attention by hand"):
        _by_hand(tmp_path, monkeypatch, BY_HAND, flat)


# ERNIE-4.5's remote code: q scaled before its product with k, the rope table counted from
# the sequence length (no positions input) and applied in [batch, seq, heads, dim]
Q_SCALED_FIRST = BY_HAND.replace(
    "    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])\n",
    "    q = q / math.sqrt(q.shape[-1])\n    scores = torch.matmul(q, k.transpose(-2, -1))\n",
)
COUNTED = "cos, sin = rope_cos_sin(torch.arange(t)[None], self.head_dim, self.theta, q.dtype)"
ROPE_PER_TOKEN = (
    "        q = q * cos + rotate_half(q) * sin\n        k = k * cos + rotate_half(k) * sin\n",
    (
        "        q = q.transpose(1, 2)\n        k = k.transpose(1, 2)\n"
        "        cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)\n"
        "        q = (q * cos + rotate_half(q) * sin).transpose(1, 2)\n"
        "        k = (k * cos + rotate_half(k) * sin).transpose(1, 2)\n"
    ),
)


def _ernie_style(tmp_path, monkeypatch, positions: str = COUNTED, scaled: str = Q_SCALED_FIRST):
    rope = "cos, sin = rope_cos_sin(positions, self.head_dim, self.theta, q.dtype)"
    return _by_hand(tmp_path, monkeypatch, BY_HAND, scaled, ((rope, positions), ROPE_PER_TOKEN))


def test_rope_counted_from_sizes_and_q_scaled_first_are_proven(tmp_path, monkeypatch):
    att = _ernie_style(tmp_path, monkeypatch).attention
    assert (
        att.attention_call is AttentionCall.CAUSAL_SDPA
        and att.rope_layers is RopeLayers.ALL
        and att.rope_style is RopeStyle.NEOX
        and att.rotary_dim == att.head_dim
    )


@pytest.mark.parametrize(
    ("positions", "scaled"),
    [
        (COUNTED.replace("torch.arange(t)", "torch.arange(1, t + 1)"), Q_SCALED_FIRST),  # shifted
        (COUNTED, Q_SCALED_FIRST.replace("q / math.sqrt(q.shape[-1])", "q / q.shape[-1]")),  # scale
    ],
)
def test_other_counted_positions_or_scales_are_refused(tmp_path, monkeypatch, positions, scaled):
    with pytest.raises(HfrewriteError, match="rope|softmax attention by hand"):
        _ernie_style(tmp_path, monkeypatch, positions, scaled)
