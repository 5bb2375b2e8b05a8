"""Config switches read off a traced module: the forward's and ``__init__``'s tests, in the
form ``__init__`` evaluates (a config expression or a constructor parameter)."""

from __future__ import annotations

from torch import nn

from hfrewrite.analyze.branches import config_switches


class Config:
    multi_query = True


class Attention(nn.Module):
    def __init__(self, config, is_cross_attention=False):
        super().__init__()
        self.multi_query = config.multi_query
        self.is_cross_attention = is_cross_attention
        self.width = 4
        if self.is_cross_attention:
            self.q = nn.Linear(4, 4)
        self.width = 8
        if self.width > 4:  # an attribute assigned twice: its final value decides nothing here
            self.k = nn.Linear(4, 4)

    def forward(self, x):
        if self.multi_query:
            return x
        return -x


def test_forward_and_init_switches_in_init_form():
    found = config_switches(Attention(Config()))
    assert found == (("config.multi_query", True), ("is_cross_attention", False))


def test_a_flag_set_by_the_constructor_is_read_as_built():
    assert ("is_cross_attention", True) in config_switches(Attention(Config(), is_cross_attention=True))


class KindConfig:
    layer_types = ("full_attention", "conv")


class Layer(nn.Module):
    """LFM2's decoder layer: its kind is the config's entry at the constructor's index."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.is_attention_layer = config.layer_types[layer_idx] == "full_attention"
        if self.is_attention_layer:
            self.attn = nn.Identity()

    def forward(self, x):
        if self.is_attention_layer:
            return self.attn(x)
        return -x


def test_a_switch_on_the_config_at_a_constructor_index_is_a_config_switch():
    test = "config.layer_types[layer_idx] == 'full_attention'"
    assert config_switches(Layer(KindConfig(), 0), "forward") == ((test, True),)
    assert config_switches(Layer(KindConfig(), 1), "init") == ((test, False),)
    assert config_switches(Layer(KindConfig(), 0)) == ((test, True),)  # the same test, once


class HybridConfig:
    layers_block_type = ("full_attention", "linear_attention")
    shared = 0


class OptionalPartsLayer(nn.Module):
    """Granite-4.0's layer: a part built under a config test, None otherwise (in an ``if``
    after ``None``, or in a conditional expression)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.mamba = None
        if config.layers_block_type[layer_idx] == "linear_attention":
            self.mamba = nn.Identity()
        self.shared_mlp = None if config.shared == 0 else nn.Identity()

    def forward(self, x):
        if self.mamba is not None:
            x = self.mamba(x)
        if self.shared_mlp is None:
            return x
        return self.shared_mlp(x)


def test_an_optional_part_is_tested_by_the_config_test_that_builds_it():
    found = config_switches(OptionalPartsLayer(HybridConfig(), 0), "forward")
    assert found == (
        ("config.layers_block_type[layer_idx] == 'linear_attention'", False),
        ("config.shared == 0", True),
    )
    assert config_switches(OptionalPartsLayer(HybridConfig(), 1), "forward")[0][1] is True


class ReassignedLayer(nn.Module):
    """A part assigned a third time is no optional part: its test is no config switch."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.mamba = None
        if config.layers_block_type[layer_idx] == "linear_attention":
            self.mamba = nn.Identity()
        self.mamba = nn.Identity()

    def forward(self, x):
        if self.mamba is not None:
            x = self.mamba(x)
        return x


class LocalTestLayer(nn.Module):
    """A part built under a test on a local of ``__init__``: no config form."""

    def __init__(self, config, layer_idx):
        super().__init__()
        kind = config.layers_block_type[layer_idx]
        self.mamba = None
        if kind == "linear_attention":
            self.mamba = nn.Identity()

    def forward(self, x):
        if self.mamba is not None:
            x = self.mamba(x)
        return x


def test_a_part_assigned_again_or_built_under_a_local_is_no_switch():
    assert config_switches(ReassignedLayer(HybridConfig(), 1), "forward") == ()
    assert config_switches(LocalTestLayer(HybridConfig(), 1), "forward") == ()
