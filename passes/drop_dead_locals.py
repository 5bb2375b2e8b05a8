"""Drop local assignments nothing reads any more.

Matches ``name = value`` among the statements of a function body when the function never
reads ``name`` and ``value`` only computes (names, attributes, constants, arithmetic,
subscripts, tuples): a size the source computed for a projection that is now a vLLM
layer built from the config (phi3's ``op_size``). Also an ``if``/``elif``/``else`` chain
whose every branch is one such assignment of that name, under tests that only compute
(Falcon's ``qkv_out_dim`` per architecture).

Emits the function without that statement.

Preconditions (otherwise the statement stays): a single plain-name target; no call in the
value (a call may have effects) but of ``PURE_CALLS`` and dtype conversions of their
results; the name is not declared ``global``/``nonlocal``.
"""

from __future__ import annotations

import libcst as cst

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pass_api import PassContext, PassResult
from hfrewrite.emit.pure_expressions import computed_local, computes_only

NAME = "drop_dead_locals"
# Functions that only compute a value from their arguments (a rope table the source built
# in ``__init__`` for a rotary the rewrite replaced).
PURE_CALLS = frozenset(
    {"torch.arange", "torch.tensor", "math.sqrt", "math.log", "float", "int", "min", "max"}
)


def _dead(statement: cst.BaseStatement, reads: dict[str, int]) -> bool:
    name = computed_local(statement, PURE_CALLS)
    if name is not None:
        return reads.get(name, 0) == 1
    chain = _assigning_chain(statement)
    return chain is not None and reads.get(chain[0], 0) == chain[1]


def _assigning_chain(statement: cst.BaseStatement) -> tuple[str, int] | None:
    """(name, branches) for ``if a: x = ... elif b: x = ... else: x = ...`` where every test
    and value only computes and each branch is one assignment of the same name."""
    names, node = [], statement
    while isinstance(node, cst.If):
        if not computes_only(node.test, PURE_CALLS) or len(node.body.body) != 1:
            return None
        names.append(computed_local(node.body.body[0], PURE_CALLS))
        node = node.orelse
        if isinstance(node, cst.Else):
            names.append(computed_local(node.body.body[0], PURE_CALLS) if len(node.body.body) == 1 else None)
            node = None
    if node is not None or None in names or len(set(names)) != 1:
        return None
    return names[0], len(names)


def _name_counts(fn: cst.FunctionDef) -> dict[str, int] | None:
    """How often each name occurs in ``fn``'s body; a keyword argument's name
    (``MambaMixer2(head_dim=...)``) is no read of a local."""
    counts: dict[str, int] = {}
    nodes = list(t.walk(fn.body))
    keywords = {id(node.keyword) for node in nodes if isinstance(node, cst.Arg) and node.keyword is not None}
    for node in nodes:
        if isinstance(node, (cst.Global, cst.Nonlocal)):
            return None
        if isinstance(node, cst.Name) and id(node) not in keywords:
            counts[node.value] = counts.get(node.value, 0) + 1
    return counts


class _DropDead(cst.CSTTransformer):
    def __init__(self) -> None:
        self.dropped = 0

    def leave_FunctionDef(self, original, updated):
        counts = _name_counts(updated)
        if counts is None:
            return updated
        body = [s for s in updated.body.body if not _dead(s, counts)]
        if not body or len(body) == len(updated.body.body):
            return updated
        self.dropped += len(updated.body.body) - len(body)
        return t.with_body(updated, body)


def _has_dead(module: cst.Module) -> bool:
    """A read-only look first: most modules have none, and then nothing is rebuilt."""
    for fn in (n for n in t.walk(module) if isinstance(n, cst.FunctionDef)):
        counts = _name_counts(fn)
        if counts is not None and any(_dead(s, counts) for s in fn.body.body):
            return True
    return False


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    if not _has_dead(module):
        return PassResult(module=module)
    dropper = _DropDead()
    module = module.visit(dropper)
    return PassResult(module=module, matches=dropper.dropped)
