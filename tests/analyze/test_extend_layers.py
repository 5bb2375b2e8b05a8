"""shrink.extend_layers: every per-layer list of a shrunk config extended alike (the shrink's
kv-sharing layers, validation's one more layer), kind lists computed from index lists too."""

from pathlib import Path

import transformers

from hfrewrite.analyze.shrink import extend_layers, shrink_config

GOLDEN_CONFIGS = Path(__file__).resolve().parents[2] / "golden" / "configs"


def test_kind_lists_and_other_per_layer_lists_grow_together():
    config = transformers.AutoConfig.for_model("laguna")
    small = shrink_config(config)
    heads, kinds = small.num_attention_heads_per_layer, small.mlp_layer_types
    extend_layers(config, small, lambda items: [*items, items[-1]])
    assert small.num_attention_heads_per_layer == [*heads, heads[-1]]
    assert small.mlp_layer_types == [*kinds, kinds[-1]]


def test_a_kind_list_computed_from_indices_sets_the_indices():
    # Bamba's layer_types is a property of attn_layer_indices
    config = transformers.AutoConfig.from_pretrained(GOLDEN_CONFIGS / "bamba")
    small = shrink_config(config)
    kinds = small.layer_types
    extend_layers(config, small, lambda items: items + items)
    small.num_hidden_layers *= 2
    assert small.layer_types == kinds + kinds
    assert small.attn_layer_indices == [i for i, kind in enumerate(kinds + kinds) if kind == "full_attention"]
