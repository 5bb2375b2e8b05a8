"""Hub custom code split over files: the repository's own modules a modeling file imports
(``from .layers import GeluMLP``), inlined so that the passes see one module.

Every top-level definition of the imported module comes in where its import was (what the
model never reaches is stripped later by ``strip_hf_runtime``); its absolute imports join the
file's. The configuration module is left to ``strip_hf_runtime`` (the configuration class
stays the repository's). Refused with the reason: a module that is not a file next to the
modeling file, ``import *``, aliases, a name defined on both sides, a module importing
further local modules.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst

from hfrewrite.emit import cst_tools as t
from hfrewrite.errors import HfrewriteError


def inline_local_imports(module: cst.Module, directory: Path) -> cst.Module:
    """``module`` with its ``from .<local> import ...`` statements replaced by the local
    modules' definitions (and their imports added after the file's own)."""
    body, imports = [], []
    own = {_defined(n) for n in module.body} - {None}
    for node in module.body:
        local = _local_import(node)
        if local is None:
            body.append(node)
            continue
        name, names = local
        theirs = _parse(directory, name)
        if any(_local_import(n) for n in theirs.body):
            raise HfrewriteError(f"{name}.py imports further modules of the repository: not inlined")
        defined = {_defined(n) for n in theirs.body} - {None}
        missing = sorted(set(names) - defined)
        if missing:
            raise HfrewriteError(f"{name}.py does not define {', '.join(missing)} at its top level")
        clash = sorted(defined & own)
        if clash:
            raise HfrewriteError(f"{clash[0]} is defined both in the modeling file and in {name}.py")
        own |= defined
        imports += [n for n in theirs.body if _is_import(n)]
        body += [n for n in theirs.body if not _is_import(n) and not _is_docstring(n)]
    at = max((i + 1 for i, n in enumerate(body) if _is_import(n)), default=0)
    return module.with_changes(body=[*body[:at], *imports, *body[at:]])


def _local_import(node: cst.CSTNode) -> tuple[str, list[str]] | None:
    """(module, names) of ``from .<module> import a, b``, not the configuration module."""
    if not (isinstance(node, cst.SimpleStatementLine) and isinstance(node.body[0], cst.ImportFrom)):
        return None
    imp = node.body[0]
    if not imp.relative:
        return None
    source = t.dotted(imp.module) if imp.module else ""
    if source.startswith("configuration_"):
        return None
    if len(node.body) != 1 or len(imp.relative) != 1 or not source or "." in source:
        raise HfrewriteError(f"`{t.code(node).strip()}`: only `from .<module> import <names>` is inlined")
    if isinstance(imp.names, cst.ImportStar) or any(a.asname for a in imp.names):
        raise HfrewriteError(f"`{t.code(node).strip()}`: `import *` and aliases are not inlined")
    return source, [a.evaluated_name for a in imp.names]


def _parse(directory: Path, name: str) -> cst.Module:
    path = directory / f"{name}.py"
    try:
        return cst.parse_module(path.read_text(encoding="utf-8"))
    except (OSError, cst.ParserSyntaxError) as exc:
        raise HfrewriteError(f"cannot read the repository's {path.name}: {exc}") from None


def _is_import(node: cst.CSTNode) -> bool:
    return isinstance(node, cst.SimpleStatementLine) and isinstance(
        node.body[0], (cst.Import, cst.ImportFrom)
    )


def _is_docstring(node: cst.CSTNode) -> bool:
    return (
        isinstance(node, cst.SimpleStatementLine)
        and isinstance(node.body[0], cst.Expr)
        and isinstance(node.body[0].value, cst.SimpleString)
    )


def _defined(node: cst.CSTNode) -> str | None:
    if isinstance(node, (cst.ClassDef, cst.FunctionDef)):
        return node.name.value
    if isinstance(node, cst.SimpleStatementLine) and isinstance(node.body[0], cst.Assign):
        targets = node.body[0].targets
        if len(targets) == 1 and isinstance(targets[0].target, cst.Name):
            return targets[0].target.value
    return None
