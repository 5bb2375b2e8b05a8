"""Learned absolute position embeddings (GPT-2, GPT-Neo, StarCoder, OPT, BioGPT): a second
embedding table of the base model whose rows, picked by position, are added to the tokens'.

Which embedding is which comes from the example run: the token table is the one called on
the input ids. The other table is proven on the values: what it returned holds, at each
position ``i`` of each sequence, its own row ``i + offset`` (OPT and BioGPT keep two rows
in front), and the first layer receives the tokens' embeddings plus those rows. The file
then adds ``weight[positions + offset]`` to the looked-up tokens, as vLLM's ``gpt2.py``
and ``opt.py`` do, whatever the source's class computes the positions from (an attention
mask's cumulative sum, an ``arange``)."""

from __future__ import annotations

import torch
from torch import nn

from hfrewrite.analyze.model_layout import buffer_table
from hfrewrite.analyze.plan import NoMatch, PositionEmbeddingPlan

MAX_OFFSET = 4  # rows kept in front of position 0 (OPT, BioGPT: 2)


def token_embedding(base: nn.Module, candidates: list[str], calls: dict, ids: torch.Tensor) -> str | None:
    """The one embedding among ``candidates`` (children of ``base``) that the example run
    called on ``ids`` (the only candidate, when there is one); where several were called on
    them (TrOCR's position table reads the ids for their shape), the one whose output is its
    weight's rows at the ids."""
    if len(candidates) == 1:
        return candidates[0]
    found = [
        name
        for name in candidates
        if name in calls
        and calls[name][0]
        and torch.is_tensor(calls[name][0][0])
        and torch.equal(calls[name][0][0], ids)
    ]
    if len(found) > 1:
        found = [name for name in found if _looks_up(base.get_submodule(name), calls[name][1], ids)]
    return found[0] if len(found) == 1 else None


def _looks_up(module: nn.Module, out, ids: torch.Tensor) -> bool:
    weight = getattr(module, "weight", None)
    if not (torch.is_tensor(out) and torch.is_tensor(weight) and weight.dim() == 2):
        return False
    if int(ids.max()) >= weight.shape[0]:
        return False
    rows = weight[ids]
    return rows.shape == out.shape and torch.equal(rows.to(out.dtype), out)


def prove_position_embedding(
    attr: str, module: nn.Module, out, tokens: torch.Tensor, first: torch.Tensor
) -> PositionEmbeddingPlan | NoMatch:
    """The plan of the table ``attr`` (which returned ``out``) when the first layer's input
    ``first`` is the tokens' embeddings plus its rows at each position and one fixed
    offset; otherwise why not."""
    name = type(module).__name__
    table = "weight" if isinstance(getattr(module, "weight", None), nn.Parameter) else buffer_table(module)
    weight = getattr(module, table, None) if table else None
    if not (torch.is_tensor(out) and torch.is_tensor(weight) and weight.dim() == 2):
        return NoMatch("position_embedding", name, f"{attr} does not return rows of one weight table")
    seq = tokens.shape[-2]
    rows = (
        out.expand_as(tokens) if out.dim() == tokens.dim() and out.shape[-2:] == tokens.shape[-2:] else None
    )
    if rows is None:
        return NoMatch(
            "position_embedding", name, f"{attr} returns {tuple(out.shape)}, not one row per position"
        )
    offsets = [
        k
        for k in range(MAX_OFFSET + 1)
        if k + seq <= weight.shape[0]
        and all(torch.equal(row, weight[k : k + seq]) for row in rows.reshape(-1, seq, weight.shape[1]))
    ]
    if len(offsets) != 1:
        return NoMatch(
            "position_embedding",
            name,
            f"the rows {attr} returns are not its weight's rows at the positions plus one offset",
        )
    if not torch.allclose(first, tokens + rows, rtol=0, atol=1e-6):
        return NoMatch(
            "position_embedding",
            name,
            f"the first layer does not receive the tokens' embeddings plus the rows of {attr}",
        )
    return PositionEmbeddingPlan(
        attr=attr,
        offset=offsets[0],
        module_call=type(module) is nn.Embedding and offsets[0] == 0,
        table=table,
    )
