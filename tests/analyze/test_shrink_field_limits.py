"""Shrunk configs of types whose fields resist the shrink still build their causal LM, so
that the analysis, not the shrink, gives the reason a type is refused: a decoder of an
encoder-decoder family with heads of its own (Whisper's, PLBart's), a config whose setter
refuses a field (ProphetNet's num_hidden_layers), a pad id field typed int (ModernBERT's)."""

import pytest
import transformers

from hfrewrite.analyze.shrink import VOCAB, shrink_config


@pytest.mark.parametrize("model_type", ["whisper", "plbart", "prophetnet", "modernbert-decoder"])
def test_the_shrunk_config_builds_its_causal_lm(model_type):
    small = shrink_config(transformers.AutoConfig.for_model(model_type))
    small._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(small)
    assert model.get_input_embeddings().num_embeddings <= VOCAB + 64  # shrunk (some pad up)


def test_a_pad_id_typed_int_becomes_the_last_id():
    config = transformers.AutoConfig.for_model("modernbert-decoder")
    assert config.pad_token_id >= VOCAB
    assert shrink_config(config).pad_token_id == VOCAB - 1


def test_decoder_heads_follow_the_shrink():
    small = shrink_config(transformers.AutoConfig.for_model("whisper"))
    assert small.decoder_attention_heads == small.encoder_attention_heads == small.num_attention_heads


def test_falcons_own_kv_head_field_follows_the_head_count():
    """Falcon names its kv heads ``num_kv_heads``: multi-head (as many as heads) stays
    multi-head at either head count the analysis traces, a grouped count stays grouped."""
    mha = transformers.AutoConfig.for_model(
        "falcon", multi_query=False, num_attention_heads=8, hidden_size=512
    )
    assert mha.num_kv_heads == 8
    assert shrink_config(mha, 4).num_kv_heads == 4 and shrink_config(mha, 8).num_kv_heads == 8
    grouped = transformers.AutoConfig.for_model("falcon", new_decoder_architecture=True, num_kv_heads=8)
    assert shrink_config(grouped, 8).num_kv_heads == 2


def test_falcon_40bs_grouped_kv_heads_are_read_through_their_broadcast():
    """Falcon-40B's layout: per kv head, its query heads then k and v, with k and v
    broadcast to every query head before the rope. The analysis proves the expansion on the
    values (each group's heads equal) and plans the kv heads the projection holds."""
    from hfrewrite.analyze.model import analyze
    from hfrewrite.analyze.qkv_layouts import QkvLayout

    config = transformers.AutoConfig.for_model(
        "falcon", new_decoder_architecture=True, num_kv_heads=8, num_attention_heads=32, hidden_size=4096
    )
    attention = analyze(config).attention
    assert (attention.num_heads, attention.num_kv_heads) == (4, 2)  # shrunk: groups of two
    assert attention.qkv_layout is QkvLayout.GROUPED
    assert (attention.heads_field, attention.kv_heads_field) == ("num_attention_heads", "num_kv_heads")


def test_an_expansion_is_proven_on_every_element():
    import torch

    from hfrewrite.analyze.gqa_expansion import expanded_from

    kv = torch.randn(2, 2, 5, 8)
    expanded = kv.repeat_interleave(3, dim=1)
    assert expanded_from(expanded, 1, 2) and not expanded_from(expanded, 1, 3)
    expanded[0, 1, 0, 0] += 1e-3  # one head of a group differs
    assert not expanded_from(expanded, 1, 2)
