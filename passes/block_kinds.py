"""Build a one-block layer's block under one test per kind, where the source reads its class from a table.

Matches the decoder layer of a plan whose layers are one block each, of a kind per layer
(``DecoderLayerPlan.block_kinds``, analyze/block_kinds.py), when its ``__init__`` builds the
block from a dict of the modeling module (NemotronH's ``self.mixer =
MIXER_TYPES[self.block_type](config, layer_idx=layer_idx)``).

Emits, in place of that statement, the lookup the dict does, for the keys the traced layers
had, so that the passes after this one find each class built by name and rewrite its
construction as any other (vLLM's attention, ``MambaMixer2``, the parallel MLP)::

    if self.block_type == "linear_attention":
        self.mixer = NemotronHMamba2Mixer(config, layer_idx=layer_idx)
    elif self.block_type == "full_attention":
        self.mixer = NemotronHAttention(config, layer_idx=layer_idx)
    else:
        raise ValueError(...)  # a kind no traced layer had: never proven

The dict goes when nothing else reads it. The forward's call of the block is the fused
layer's (fused_residual_norm): ``isinstance(self.mixer, <attention class>)`` chooses vLLM's
attention call.

Preconditions: the statement is in ``__init__`` as the analysis read it, once.
"""

from __future__ import annotations

import libcst as cst

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites
from hfrewrite.errors import HfrewriteError

NAME = "block_kinds"


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    layer = ctx.plan.decoder_layer
    kinds = layer.block_kinds
    if kinds is None or not kinds.table:
        return PassResult(module=module)
    sites = Sites()
    cls = t.find_class(module, layer.module_class)
    chooser = _ByKind(kinds)
    cls = t.set_method(cls, t.find_method(cls, "__init__").visit(chooser))
    if chooser.count != 1:
        raise HfrewriteError(
            f"{layer.module_class}: {NAME}: self.{kinds.attr} is not built once from {kinds.table}[{kinds.key}]"
        )
    module = sites.replace_class(module, layer.module_class, cls)
    without = module.with_changes(body=[n for n in module.body if not _defines(n, kinds.table)])
    if kinds.table not in t.names_used(without):  # nothing else reads the table
        module = without
    shown = ", ".join(f"{key}: {name}" for key, name in kinds.kinds)
    row = FusionRow(
        layer.module_class, f"{kinds.attr}: built by kind ({shown}), as {kinds.table} looks them up"
    )
    return PassResult(module=module, fused=(row,), matches=sites.count)


class _ByKind(cst.CSTTransformer):
    """``self.<attr> = <table>[<key>](args)`` -> one test of ``<key>`` per traced kind."""

    def __init__(self, kinds) -> None:
        self.kinds, self.count = kinds, 0

    def leave_SimpleStatementLine(self, original, updated):
        if t.self_attr_assigned(updated) != self.kinds.attr:
            return updated
        call = t.assigned_value(updated)
        if not (
            isinstance(call, cst.Call)
            and isinstance(call.func, cst.Subscript)
            and t.code(call.func.value) == self.kinds.table
            and len(call.func.slice) == 1
            and t.code(call.func.slice[0].slice.value) == self.kinds.key
        ):
            return updated
        self.count += 1
        args = t.code(call.with_changes(func=cst.Name("f")))[1:]  # "(config, layer_idx=...)"
        key, attr = self.kinds.key, self.kinds.attr
        branches = [
            f"{'if' if i == 0 else 'elif'} {key} == {value!r}:\n    self.{attr} = {name}{args}\n"
            for i, (value, name) in enumerate(self.kinds.kinds)
        ]
        proven = tuple(value for value, _ in self.kinds.kinds)
        message = f"hfrewrite: this file needs {key} in {proven!r}: the kinds of {attr} it was proven with"
        chain = t.stmt("".join(branches) + f"else:\n    raise ValueError({message!r})\n")
        return chain.with_changes(leading_lines=updated.leading_lines)


def _defines(node: cst.CSTNode, name: str) -> bool:
    """``node`` is the module-level statement ``<name> = ...``."""
    return (
        isinstance(node, cst.SimpleStatementLine)
        and isinstance(node.body[0], cst.Assign)
        and len(node.body[0].targets) == 1
        and t.code(node.body[0].targets[0].target) == name
    )
