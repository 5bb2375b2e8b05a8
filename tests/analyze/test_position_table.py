"""A position table held as a buffer of the base model itself (CTRL) is proven on the values:
the first layer receives the tokens' rows, times one number the forward computes, plus the
table's rows at the positions; the number's own expression is what the file writes."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from transformers import AutoConfig

from hfrewrite.analyze.model import analyze
from hfrewrite.analyze.position_table import base_position_table


class Base(nn.Module):
    """CTRL's shape: the table a buffer of the base model, the tokens scaled in place."""

    def __init__(self, scale_by_width: bool = True):
        super().__init__()
        self.d_model_size = 8
        self.scale_by_width = scale_by_width
        self.w = nn.Embedding(32, 8)
        self.pos_encoding = nn.Buffer(torch.randn(16, 8), persistent=False)

    def forward(self, ids):
        inputs_embeds = self.w(ids)
        if self.scale_by_width:
            inputs_embeds *= np.sqrt(self.d_model_size)
        return inputs_embeds + self.pos_encoding[torch.arange(ids.shape[1])[None], :]


def _run(base: Base):
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    with torch.no_grad():
        return base.w(ids), base(ids)


def test_rows_of_a_base_buffer_added_to_scaled_tokens_are_proven_with_the_sources_factor():
    torch.manual_seed(0)
    base = Base()
    plan = base_position_table(base, *_run(base))
    assert (plan.attr, plan.table, plan.offset, plan.module_call) == ("", "pos_encoding", 0, False)
    assert plan.token_scale == "np.sqrt(self.d_model_size)"


def test_unscaled_tokens_need_no_factor():
    torch.manual_seed(0)
    base = Base(scale_by_width=False)
    assert base_position_table(base, *_run(base)).token_scale is None


def test_a_scale_no_statement_of_the_forward_computes_is_refused():
    torch.manual_seed(0)
    base = Base(scale_by_width=False)
    tokens, first = _run(base)
    rows = first - tokens
    assert base_position_table(base, tokens, tokens * 3.0 + rows) is None


def test_rows_that_are_not_the_tables_at_the_positions_are_refused():
    torch.manual_seed(0)
    base = Base()
    tokens, first = _run(base)
    assert base_position_table(base, tokens, first.flip(1)) is None  # the positions reversed
    assert base_position_table(base, tokens, first + 0.5) is None


def test_ctrl_reads_its_sinusoidal_table_and_its_scaled_tokens():
    plan = analyze(AutoConfig.for_model("ctrl"))
    position = plan.position_embedding
    assert (position.attr, position.table, position.offset) == ("", "pos_encoding", 0)
    assert position.token_scale == "np.sqrt(self.d_model_size)"
    assert not plan.embeddings_transformed
