"""A configuration that derives fields in its ``__init__`` or ``__post_init__`` (OpenELM's head
counts per layer, Zamba2's Mamba head size) is built again from the shrunk values, so that the
traced model is the one a checkpoint saved from that config loads as."""

from __future__ import annotations

import transformers
from transformers import PretrainedConfig

from hfrewrite.analyze.shrink import _rebuilt, shrink_config


class DerivingConfig(PretrainedConfig):
    model_type = "deriving"

    def __init__(self, num_layers=4, dim=64, **kwargs):
        self.num_layers = num_layers
        self.dim = dim
        self.widths = [dim * (i + 1) for i in range(num_layers)]  # derived, no parameter
        super().__init__(**kwargs)


def test_fields_the_class_derives_are_derived_from_the_shrunk_ones():
    small = DerivingConfig(auto_map={"AutoConfig": "configuration_deriving.DerivingConfig"})
    small.num_layers, small.dim = 2, 32  # what the shrink sets
    assert small.widths == [64, 128, 192, 256]  # stale
    rebuilt = _rebuilt(small)
    assert (rebuilt.num_layers, rebuilt.dim, rebuilt.widths) == (2, 32, [32, 64])
    assert rebuilt.auto_map == small.auto_map


def test_a_library_configuration_derives_its_fields_from_the_shrunk_sizes():
    # Zamba2's __post_init__ derives the Mamba head size, the attention width and the hybrid
    # layers' indices from the full sizes; the shrunk copy derives them from its own
    config = transformers.AutoConfig.for_model("zamba2")
    assert (config.mamba_headdim, config.attention_hidden_size) == (640, 5120)
    small = shrink_config(config)
    assert small.hidden_size == 128
    assert small.mamba_headdim == small.mamba_expand * small.hidden_size // small.n_mamba_heads
    assert small.attention_hidden_size == 2 * small.hidden_size
    assert small.hybrid_layer_ids == [i for i, t in enumerate(small.layers_block_type) if t == "hybrid"]


def test_a_configuration_deriving_nothing_is_left_as_shrunk():
    small = transformers.LlamaConfig(num_hidden_layers=2)
    assert _rebuilt(small) is small
