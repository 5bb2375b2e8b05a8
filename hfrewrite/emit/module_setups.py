"""Top-level statements of 4.x-era modeling files that set things up for transformers
(``strip_hf_runtime`` drops them once nothing in the file needs what they bind)."""

from __future__ import annotations

import builtins

import libcst as cst

from hfrewrite.emit import cst_tools as t


def without_unused_setups(module: cst.Module, names_used) -> cst.Module:
    """Top-level ``try: import x / except ImportError: ...`` (an optional dependency such as
    xformers, a warning when it is missing), or ``if is_torch_fx_available(): f = torch.fx.wrap(f)``
    (maybe with its own ``if ...: import torch.fx``), whose guarded imports and assignments
    bind names nothing else reads (a submodule import of a package the module imports anyway
    aside)."""
    body = list(module.body)
    imported = set().union(*(t.bound_names(n) for n in body if _is_import_line(n)))
    for node in list(body):
        if isinstance(node, cst.Try):
            guarded = list(node.body.body)
            binds_only = all(_is_import_line(s) for s in guarded)
        elif isinstance(node, cst.If) and node.orelse is None:
            guarded = _flattened_ifs(node.body.body)
            binds_only = guarded is not None and all(
                _is_import_line(s) or _is_assignment_line(s) for s in guarded
            )
        else:
            continue
        if not binds_only:
            continue
        bound = set().union(*(_bound_apart_from(s, imported) for s in guarded))
        rest = set().union(*(names_used(n) for n in body if n is not node and not _is_import_line(n)))
        if bound and not bound & rest:
            body.remove(node)
    return module.with_changes(body=body)


def without_registrations_of_dropped(module: cst.Module) -> cst.Module:
    """Top-level expression statements naming a class or function the rewrite dropped
    (``ALL_LAYERNORM_LAYERS.append(XRMSNorm)``, transformers' own bookkeeping): nothing
    binds that name any more, and vLLM has no use for the registration."""
    bound = set().union(*(t.bound_names(n) for n in module.body)) | set(dir(builtins))
    body = [
        n
        for n in module.body
        if not (
            isinstance(n, cst.SimpleStatementLine)
            and all(isinstance(s, cst.Expr) for s in n.body)
            and t.root_names(n) - bound
        )
    ]
    return module.with_changes(body=body)


def _flattened_ifs(statements) -> list[cst.BaseStatement] | None:
    """The simple statements of a block, those of nested ``if``s (no ``else``) included."""
    flat: list[cst.BaseStatement] = []
    for s in statements:
        if isinstance(s, cst.If) and s.orelse is None:
            inner = _flattened_ifs(s.body.body)
            if inner is None:
                return None
            flat += inner
        elif isinstance(s, cst.SimpleStatementLine):
            flat.append(s)
        else:
            return None
    return flat


def _bound_apart_from(statement: cst.BaseStatement, imported: set[str]) -> set[str]:
    """The names a statement binds; ``import torch.fx`` binds none when ``torch`` is imported."""
    if _is_import_line(statement) and all(
        isinstance(s, cst.Import) and all("." in t.code(a.name) for a in s.names) for s in statement.body
    ):
        return t.bound_names(statement) - imported
    return t.bound_names(statement)


def _is_import_line(node: cst.CSTNode) -> bool:
    return isinstance(node, cst.SimpleStatementLine) and all(
        isinstance(s, cst.Import | cst.ImportFrom) for s in node.body
    )


def _is_assignment_line(node: cst.CSTNode) -> bool:
    return isinstance(node, cst.SimpleStatementLine) and all(isinstance(s, cst.Assign) for s in node.body)
