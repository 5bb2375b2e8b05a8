"""What ``passes/strip_hf_runtime.py`` makes of a modeling file's relative imports: the names
they bring from Transformers internals, and the absolute imports the converted file keeps
instead (the configuration class from ``transformers``, helpers such as ``ACT2FN`` from
their module; Hub custom code: ``PretrainedConfig``, and a refusal for the repository's own
helpers)."""

from __future__ import annotations

import libcst as cst

from hfrewrite.emit import cst_tools as t
from hfrewrite.errors import HfrewriteError

NAME = "strip_hf_runtime"


def relative_imports(module: cst.Module) -> tuple[set[str], list[str]]:
    """Names imported from Transformers internals, and the configuration classes among them."""
    names, configs = set(), []
    for node in module.body:
        if isinstance(node, cst.SimpleStatementLine) and isinstance(node.body[0], cst.ImportFrom):
            imp = node.body[0]
            if imp.relative and not isinstance(imp.names, cst.ImportStar):
                source = t.dotted(imp.module) if imp.module else ""
                for alias in imp.names:
                    names.add(alias.evaluated_alias or alias.evaluated_name)
                    if source.startswith("configuration_"):
                        configs.append(alias.evaluated_name)
    return names, configs


def with_absolute_imports(
    module: cst.Module,
    configs: list[str],
    names_used,
    custom_code: bool,
    modeling_file: str,
    shim_helpers: frozenset[str] = frozenset(),
) -> cst.Module:
    """``module`` with its relative imports replaced by absolute imports of what it still uses;
    ``shim_helpers``: names the config shim defines in the file, used as they are."""
    configs = [c for c in configs if c not in shim_helpers]
    module, relative = _without_relative_imports(module)
    relative = [_without_names(imp, shim_helpers) for imp in relative]
    relative = [imp for imp in relative if imp is not None]
    still_used = set().union(*(names_used(n) for n in module.body)) - {c for c in configs}
    if custom_code:  # the repository's modules cannot be imported from the generated file
        module, configs = _as_pretrained_config(module, configs, names_used)
        _refuse_repository_helpers(relative, still_used)
    from_transformers = "".join(f"from transformers import {c}\n" for c in configs)
    imports = from_transformers + _carried_imports(relative, still_used, modeling_file)
    return _after_last_import(module, imports) if imports else module


def _without_names(imp: cst.ImportFrom, names: frozenset[str]) -> cst.ImportFrom | None:
    """``imp`` without the aliases binding ``names``; None when none is left."""
    if isinstance(imp.names, cst.ImportStar) or not names:
        return imp
    kept = [a for a in imp.names if (a.evaluated_alias or a.evaluated_name) not in names]
    if not kept:
        return None
    kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return imp.with_changes(names=kept)


def _without_relative_imports(module: cst.Module) -> tuple[cst.Module, list[cst.ImportFrom]]:
    """``module`` without its relative imports, and those imports."""
    body, relative = [], []
    for node in module.body:
        if isinstance(node, cst.SimpleStatementLine):  # `from .a import x; import y` splits
            ours = [s for s in node.body if isinstance(s, cst.ImportFrom) and s.relative]
            relative += ours
            if ours:
                rest = [s for s in node.body if s not in ours]
                if not rest:
                    continue
                node = node.with_changes(
                    body=[s.with_changes(semicolon=cst.MaybeSentinel.DEFAULT) for s in rest]
                )
        body.append(node)
    return module.with_changes(body=body), relative


def _as_pretrained_config(module: cst.Module, configs: list[str], names_used) -> tuple[cst.Module, list[str]]:
    """Custom code: what still names the repository's configuration class names its base,
    ``PretrainedConfig`` (vLLM hands the model an instance of the repository's class)."""
    used = set(configs) & set().union(*(names_used(n) for n in module.body))
    if not used:
        return module, []

    class _Rename(cst.CSTTransformer):
        def leave_Name(self, original, updated):
            return updated.with_changes(value="PretrainedConfig") if updated.value in used else updated

    return module.visit(_Rename()), ["PretrainedConfig"]


def _refuse_repository_helpers(relative: list[cst.ImportFrom], still_used: set[str]) -> None:
    """Custom code: refused when the converted code still uses a name from the repository's
    own modules."""
    local = sorted(
        a.evaluated_alias or a.evaluated_name
        for imp in relative
        if not isinstance(imp.names, cst.ImportStar)
        for a in imp.names
        if (a.evaluated_alias or a.evaluated_name) in still_used
    )
    if local:
        raise HfrewriteError(
            f"{NAME}: the converted code still uses {', '.join(local)} from the repository's "
            "own modules, which the generated file cannot import"
        )


def _carried_imports(relative: list[cst.ImportFrom], still_used: set[str], modeling_file: str) -> str:
    """``from <absolute module> import <name>`` for each relatively imported name still used."""
    return "".join(
        f"from {_absolute(imp, modeling_file)} import {name}\n"
        for imp in relative
        if not isinstance(imp.names, cst.ImportStar)
        for name in (
            a.evaluated_name for a in imp.names if (a.evaluated_alias or a.evaluated_name) in still_used
        )
    )


def _absolute(imp: cst.ImportFrom, modeling_file: str) -> str:
    """The absolute module of a relative import inside transformers/models/<dir>/."""
    package = [
        "transformers",
        "models",
        modeling_file.removeprefix("modeling_").removesuffix(".py"),
    ]
    level = len(imp.relative)
    parts = package[: len(package) - level + 1]
    return ".".join([*parts, t.dotted(imp.module)] if imp.module else parts)


def _after_last_import(module: cst.Module, code: str) -> cst.Module:
    """``module`` with ``code``'s statements right after its last import."""
    at = (
        max(
            i
            for i, n in enumerate(module.body)
            if isinstance(n, cst.SimpleStatementLine) and isinstance(n.body[0], (cst.Import, cst.ImportFrom))
        )
        + 1
    )
    return module.with_changes(body=[*module.body[:at], *t.stmts(code), *module.body[at:]])
