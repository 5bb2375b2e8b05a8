"""The names a piece of code binds locally, read off its targets (not its reads)."""

from __future__ import annotations

import libcst as cst

from hfrewrite.emit.cst_tools import walk


def names_bound(node: cst.CSTNode) -> set[str]:
    """Names bound anywhere under ``node``: assignment (plain, augmented, annotated), ``for``,
    ``with ... as``, parameters of nested functions and lambdas."""
    names: set[str] = set()
    for n in walk(node):
        if isinstance(n, cst.AssignTarget | cst.AugAssign | cst.AnnAssign | cst.For):
            names |= target_names(n.target)
        elif isinstance(n, cst.AsName):
            names |= target_names(n.name)
        elif isinstance(n, cst.Param):
            names.add(n.name.value)
    return names


def target_names(target: cst.BaseExpression) -> set[str]:
    """The names an assignment target binds: ``a``, ``(a, *b)``; ``x.y`` and ``x[i]`` bind none."""
    if isinstance(target, cst.Name):
        return {target.value}
    if isinstance(target, cst.Tuple | cst.List):
        return set().union(*(target_names(e.value) for e in target.elements))
    if isinstance(target, cst.StarredElement):
        return target_names(target.value)
    return set()
