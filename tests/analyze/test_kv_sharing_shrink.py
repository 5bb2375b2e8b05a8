"""The shrunk copy of a config whose last layers reuse earlier layers' keys and values
(Gemma-3n's ``num_kv_shared_layers``): each layer kind traced unshared and shared, and the
model builds (the default config's 15 shared of 35 layers, cut to 2 layers, did not)."""

import transformers

from hfrewrite.analyze.shrink import shrink_config


def test_each_kind_is_shrunk_once_unshared_then_once_shared():
    config = transformers.AutoConfig.for_model("gemma3n_text")
    assert config.num_kv_shared_layers > 0
    small = shrink_config(config)
    n = small.num_hidden_layers
    assert small.num_kv_shared_layers == n // 2
    kinds = small.layer_types[: n // 2]
    assert set(kinds) == set(config.layer_types) and small.layer_types == kinds + kinds
    # the per-layer lists follow the layers
    assert len(small.activation_sparsity_pattern) == n
    small._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(small)
    shared = [layer.self_attn.is_kv_shared_layer for layer in model.model.layers]
    assert shared == [False] * (n // 2) + [True] * (n // 2)


def test_configs_without_kv_sharing_are_unchanged():
    config = transformers.AutoConfig.for_model("gemma3_text")
    small = shrink_config(config)
    assert not hasattr(small, "num_kv_shared_layers")
    assert small.num_hidden_layers == 2
