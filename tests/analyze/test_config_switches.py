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
