"""Learned absolute position tables are told apart from the token table by the example run
and proven on the values: rows at the positions plus one offset, added to the tokens'."""

from __future__ import annotations

import torch
from torch import nn

from hfrewrite.analyze.plan import NoMatch, PositionEmbeddingPlan
from hfrewrite.analyze.position_embedding import prove_position_embedding, token_embedding


class Shifted(nn.Embedding):
    """OPT's table: two rows kept in front, positions counted from a mask."""

    def forward(self, mask):
        return super().forward(torch.cumsum(mask, dim=1).long() - 1 + 2)


def _tables(seed: int = 0):
    torch.manual_seed(seed)
    return nn.Embedding(32, 8), nn.Embedding(16, 8)


def test_the_token_table_is_the_one_called_on_the_ids():
    base = nn.ModuleDict(dict(zip(("wte", "wpe"), _tables())))
    ids, positions = torch.tensor([[5, 6, 7]]), torch.arange(3)[None]
    calls = {"wte": ((ids,), None), "wpe": ((positions,), None)}
    assert token_embedding(base, ["wte", "wpe"], calls, ids) == "wte"
    assert token_embedding(base, ["wpe", "wte"], calls, ids) == "wte"
    assert token_embedding(base, ["wte"], {}, ids) == "wte"  # the only one: nothing to tell apart


def test_of_two_tables_called_on_the_ids_the_token_table_is_the_lookup_of_them():
    # TrOCR's position table reads the ids for their shape and returns its rows at 2, 3, ...
    wte, wpe = _tables()
    base = nn.ModuleDict({"embed_tokens": wte, "embed_positions": wpe})
    ids = torch.tensor([[5, 6, 7]])
    calls = {
        "embed_tokens": ((ids,), wte(ids)),
        "embed_positions": ((ids,), wpe(torch.arange(3)[None] + 2)),
    }
    assert token_embedding(base, ["embed_positions", "embed_tokens"], calls, ids) == "embed_tokens"
    both_lookups = {**calls, "embed_positions": ((ids,), wpe(ids))}
    assert token_embedding(base, ["embed_positions", "embed_tokens"], both_lookups, ids) is None


def test_rows_at_the_positions_added_to_the_tokens_are_proven():
    wte, wpe = _tables()
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    tokens, rows = wte(ids), wpe(torch.arange(4)[None])
    plan = prove_position_embedding("wpe", wpe, rows, tokens, tokens + rows)
    assert plan == PositionEmbeddingPlan(attr="wpe", offset=0, module_call=True)


def test_an_offset_table_of_a_subclass_is_read_by_weight():
    wte, _ = _tables()
    table = Shifted(16, 8)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    tokens, rows = wte(ids), table(torch.ones(2, 4))
    plan = prove_position_embedding("embed_positions", table, rows, tokens, tokens + rows)
    assert plan == PositionEmbeddingPlan(attr="embed_positions", offset=2, module_call=False)


def test_rows_not_taken_at_the_positions_are_refused():
    wte, wpe = _tables()
    ids = torch.tensor([[1, 2, 3, 4]])
    tokens, rows = wte(ids), wpe(torch.tensor([[0, 2, 1, 3]]))  # shuffled positions
    result = prove_position_embedding("wpe", wpe, rows, tokens, tokens + rows)
    assert isinstance(result, NoMatch) and "plus one offset" in result.reason


def test_a_first_layer_input_other_than_the_sum_is_refused():
    wte, wpe = _tables()
    ids = torch.tensor([[1, 2, 3, 4]])
    tokens, rows = wte(ids), wpe(torch.arange(4)[None])
    result = prove_position_embedding("wpe", wpe, rows, tokens, tokens * 2 + rows)
    assert isinstance(result, NoMatch) and "plus the rows of wpe" in result.reason


class Sinusoids(nn.Module):
    """XGLM's table: built by __init__ as a buffer (not in the checkpoint), two rows in front."""

    def __init__(self, positions: int, dim: int) -> None:
        super().__init__()
        angles = torch.arange(positions + 2)[:, None] * torch.exp(-torch.arange(dim // 2) / dim)[None]
        self.weights = nn.Buffer(torch.cat([angles.sin(), angles.cos()], dim=1), persistent=False)

    def forward(self, position_ids):
        return self.weights.index_select(0, (position_ids + 2).view(-1)).view(*position_ids.shape, -1)


def test_a_table_its_module_builds_as_a_buffer_is_read_by_that_buffer():
    wte, _ = _tables()
    table = Sinusoids(16, 8)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    tokens, rows = wte(ids), table(torch.arange(4)[None].expand(2, 4))
    plan = prove_position_embedding("embed_positions", table, rows, tokens, tokens + rows)
    assert plan == PositionEmbeddingPlan(attr="embed_positions", offset=2, module_call=False, table="weights")
