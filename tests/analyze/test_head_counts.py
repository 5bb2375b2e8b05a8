"""Head counts no config field holds come from the attention's own ``__init__`` expression,
with the attributes it reads replaced by their config expressions (analyze/head_counts.py);
the switches of the methods a forward calls are found where the traced config reaches them
(analyze/branches.py)."""

from types import SimpleNamespace

from torch import nn

from hfrewrite.analyze.branches import config_switches, forward_helpers
from hfrewrite.analyze.head_counts import count_expression

CONFIG = SimpleNamespace(num_attention_heads=4, num_kv_heads=4, multi_query=True, new_arch=False)


class FalconStyle(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.multi_query = config.multi_query
        self.new_arch = config.new_arch
        self.num_kv_heads = config.num_kv_heads if (self.new_arch or not self.multi_query) else 1

    def forward(self, x):
        if self.new_arch:
            return self._grouped(x)
        return self._split(x)

    def _split(self, x):
        if self.multi_query:
            return x
        return -x

    def _grouped(self, x):
        if self.config.num_kv_heads > 1:
            return x
        return -x


def test_a_count_no_field_holds_is_the_sources_expression():
    module = FalconStyle(CONFIG)
    assert count_expression(module, CONFIG, 1) == (
        "config.num_kv_heads if config.new_arch or not config.multi_query else 1"
    )
    assert count_expression(module, CONFIG, 4) == "config.num_attention_heads"


def test_ambiguous_or_computed_counts_are_not_taken():
    class TwoWays(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_kv_heads = config.num_kv_heads if not config.multi_query else 1
            self.groups = config.num_attention_heads // 4  # also 1 here

    assert count_expression(TwoWays(CONFIG), CONFIG, 1) is None

    class Computed(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_kv_heads = max(1, config.num_kv_heads // 4)

    assert count_expression(Computed(CONFIG), CONFIG, 1) is None  # a call: not an expression of the config


def test_switches_of_the_helpers_the_traced_forward_reaches():
    module = FalconStyle(CONFIG)
    assert forward_helpers(module) == ("_split",)  # _grouped sits under `if self.new_arch` (False)
    assert config_switches(module, "helpers") == (("config.multi_query", True),)
    assert ("config.new_arch", False) in config_switches(module)


class SizesGiven(nn.Module):
    """XGLM's attention: its sizes are __init__'s parameters; it sees no config."""

    def __init__(self, embed_dim, num_heads, dropout=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads


def test_without_a_config_the_count_is_the_parameter_the_attribute_holds():
    module = SizesGiven(128, 4)
    assert count_expression(module, CONFIG, 4) == "num_heads"
    assert count_expression(module, CONFIG, 32) == "embed_dim // num_heads"  # head_dim's, by value
    assert count_expression(module, CONFIG, 3) is None  # no attribute holds it


def test_a_count_only_a_local_holds_is_taken_where_it_gives_each_layer_its_own():
    """MiMo-V2-Flash's kv heads: a local of __init__ (doubled on sliding layers), which no
    attribute keeps; taken as the expression giving each traced layer its count."""

    class PerLayer(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.layer_idx = layer_idx
            sliding = config.layer_types[layer_idx] == "sliding"
            kv_heads = config.num_kv_heads * 2 if sliding else config.num_kv_heads
            self.k_proj = nn.Linear(8, kv_heads * 2)

    config = SimpleNamespace(num_kv_heads=2, layer_types=["full", "sliding"])
    full, sliding = PerLayer(config, 0), PerLayer(config, 1)
    expression = count_expression(full, config, 2, [(sliding, 4)])
    assert (
        expression
        == "config.num_kv_heads * 2 if config.layer_types[layer_idx] == 'sliding' else config.num_kv_heads"
    )
    assert count_expression(full, config, 2, [(sliding, 3)]) is None  # gives the other layer 4
