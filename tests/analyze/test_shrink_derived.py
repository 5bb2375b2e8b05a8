"""A repository's configuration that derives fields in its ``__init__`` (OpenELM's head counts
per layer) is built again from the shrunk values, so that the traced model is the one a
checkpoint saved from that config loads as."""

from __future__ import annotations

from transformers import PretrainedConfig

from hfrewrite.analyze.shrink import _rebuilt


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


def test_a_library_configuration_is_left_as_shrunk():
    small = DerivingConfig()  # no auto_map: transformers' own classes derive nothing this way
    small.num_layers = 2
    assert _rebuilt(small) is small
