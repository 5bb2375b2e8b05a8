"""Load a template from ``templates/`` as a libcst tree with its names replaced."""

from __future__ import annotations

from functools import cache
from importlib.resources import files

import libcst as cst


@cache
def _parsed(name: str) -> cst.Module:
    return cst.parse_module(files("hfrewrite.templates").joinpath(name).read_text())


class _Rename(cst.CSTTransformer):
    def __init__(self, names: dict[str, str], attrs: dict[str, str]) -> None:
        self.names, self.attrs = names, attrs

    def leave_Name(self, original, updated):
        return updated.with_changes(value=self.names.get(updated.value, updated.value))

    def leave_Attribute(self, original, updated):
        new = self.attrs.get(updated.attr.value)
        return updated.with_changes(attr=cst.Name(new)) if new else updated

    def leave_Call(self, original, updated):
        """``maybe_prefix(prefix, "model")``: the prefix names the renamed attribute too."""
        if not (isinstance(updated.func, cst.Name) and updated.func.value == "maybe_prefix"):
            return updated
        args = list(updated.args)
        last = args[-1].value if args else None
        if isinstance(last, cst.SimpleString) and last.evaluated_value in self.attrs:
            args[-1] = args[-1].with_changes(value=cst.SimpleString(f'"{self.attrs[last.evaluated_value]}"'))
        return updated.with_changes(args=args)


def template_class(file: str, cls: str, names: dict[str, str], attrs: dict[str, str]) -> cst.ClassDef:
    """Class (or function) ``cls`` of ``templates/<file>`` with Name and attribute renames applied."""
    for node in _parsed(file).body:
        if isinstance(node, (cst.ClassDef, cst.FunctionDef)) and node.name.value == cls:
            # attribute names first, so that `self.model` -> `self.<attr>` sees the old names
            return node.visit(_Rename(names, attrs))
    raise KeyError(f"templates/{file} has no class {cls}")


def insert_before(module: cst.Module, name: str, new: cst.ClassDef | cst.FunctionDef) -> cst.Module:
    """``module`` with ``new`` (a template's class or function) inserted before its top-level
    class ``name``."""
    body = list(module.body)
    at = next(i for i, n in enumerate(body) if isinstance(n, cst.ClassDef) and n.name.value == name)
    body.insert(at, new.with_changes(leading_lines=body[at].leading_lines))
    return module.with_changes(body=body)
