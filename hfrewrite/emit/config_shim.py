"""The repository's configuration class, carried into the generated file as a config shim.

Hub custom code written for transformers 4.x ships a configuration class that vLLM's
transformers 5 loads differently or not at all (``rope_scaling`` is read back as
transformers' standardised rope dict; validators written for ``None`` then fail). The
generated file carries that class as written, with what it needs from its module (imports,
helpers, constants it names), and keeps ``rope_scaling`` the plain attribute it was in 4.x.
vLLM registers it for the model type the way it registers its own config shims
(``_CONFIG_REGISTRY``): the plugin and the validation worker do so before vLLM reads the
checkpoint's config.json, so ``trust_remote_code`` is not needed to load it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.errors import HfrewriteError

SHIM_NOTE = "hfrewrite config shim"


def shim_statements(
    config_path: Path,
    class_name: str,
    model_type: str,
    sizes: tuple[tuple[str, str], ...] = (),
    also: frozenset[str] = frozenset(),
) -> list[cst.CSTNode]:
    """Top-level statements defining ``class_name`` as the repository's module does, with
    the helpers and imports it names; ``sizes``: (name, expression of ``self``) of what vLLM
    reads to size the model, which the class holds under names of its own (analyze/vllm_sizes.py);
    ``also``: other names of the module the modeling file imports (OpenELM's ``make_divisible``)."""
    try:
        module = cst.parse_module(Path(config_path).read_text(encoding="utf-8"))
    except (OSError, cst.ParserSyntaxError) as exc:
        raise HfrewriteError(f"cannot read the repository's configuration {config_path}: {exc}") from None
    defined = {name: node for node in module.body for name in t.bound_names(node)}
    if class_name not in defined or not isinstance(defined[class_name], cst.ClassDef):
        raise HfrewriteError(f"{Path(config_path).name} does not define {class_name} at its top level")
    needed, todo = set(), [class_name, *sorted(also & set(defined))]
    while todo:
        name = todo.pop()
        if name in needed or name not in defined:
            continue
        needed.add(name)
        todo += sorted(_names(defined[name]))
    kept = []
    for node in module.body:
        names = t.bound_names(node) & needed
        if not names:
            continue
        if isinstance(node, cst.SimpleStatementLine) and isinstance(
            node.body[0], cst.ImportFrom | cst.Import
        ):
            node = _only(node, names)
        elif isinstance(node, cst.ClassDef) and node.name.value == class_name:
            node = _with_sizes(_shim_class(node, model_type), sizes)
        kept.append(node)
    return kept


def _names(node: cst.CSTNode) -> set[str]:
    code = cst.Module([]).code_for_node(node)
    return {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)}


def _only(node: cst.SimpleStatementLine, names: set[str]) -> cst.SimpleStatementLine:
    stmt = node.body[0]
    aliases = [
        a
        for a in stmt.names
        if cst.Module([]).code_for_node(a.asname.name if a.asname else a.name).split(".")[0] in names
    ]
    aliases[-1] = aliases[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return node.with_changes(body=[stmt.with_changes(names=aliases)])


def _shim_class(node: cst.ClassDef, model_type: str) -> cst.ClassDef:
    """The class with a note in its docstring, transformers 4's ``tie_word_embeddings = True``
    default as a class attribute (a config.json value still sets it), ``rope_scaling`` a
    plain attribute again (transformers 5 makes it an alias of the standardised
    ``rope_parameters``), and its own ``__post_init__`` renamed (``OWN_POST_INIT``)."""
    note = cst.parse_statement(
        f'"""{SHIM_NOTE}: the repository\'s configuration class as written,\n'
        f'    registered with vLLM for model type {model_type!r}.\n    """'
    )
    body = list(node.body.body)
    if body and _is_docstring(body[0]):
        body = body[1:]
    if "model_type" not in {n for stmt in body for n in t.bound_names(stmt)}:
        body.insert(0, cst.parse_statement(f"model_type = {model_type!r}"))
    if "tie_word_embeddings" not in {n for stmt in body for n in t.bound_names(stmt)}:
        comment = "# transformers 4's default, which the repository's checkpoints assume (5 sets none)"
        tied = cst.parse_statement("tie_word_embeddings = True").with_changes(
            leading_lines=[cst.EmptyLine(comment=cst.Comment(comment))]
        )
        body.insert(0, tied)
    if "self.rope_scaling" in cst.Module([]).code_for_node(node):
        comment = "# a plain attribute, as under transformers 4 (5 aliases it to rope_parameters)"
        plain = cst.parse_statement("rope_scaling = None").with_changes(
            leading_lines=[cst.EmptyLine(comment=cst.Comment(comment))]
        )
        body.insert(0, plain)
    node = node.with_changes(body=node.body.with_changes(body=[note, *body]))
    return node.visit(_OwnPostInit()) if "__post_init__" in _methods(node) else node


# the name the repository's own ``__post_init__`` takes in the shim: transformers 5's
# PretrainedConfig calls ``__post_init__(**kwargs)`` itself (a dataclass hook), which a 4.x
# method of that name (OpenELM's, called from its ``__init__``) does not take
OWN_POST_INIT = "_post_init_as_in_4x"


def _methods(node: cst.ClassDef) -> set[str]:
    return {s.name.value for s in node.body.body if isinstance(s, cst.FunctionDef)}


class _OwnPostInit(cst.CSTTransformer):
    """``def __post_init__`` and ``self.__post_init__()`` under ``OWN_POST_INIT``."""

    def leave_FunctionDef(self, original, updated):
        if updated.name.value == "__post_init__":
            return updated.with_changes(name=cst.Name(OWN_POST_INIT))
        return updated

    def leave_Attribute(self, original, updated):
        if updated.attr.value == "__post_init__" and m.matches(updated.value, m.Name("self")):
            return updated.with_changes(attr=cst.Name(OWN_POST_INIT))
        return updated


_SIZE = """\
@property
def {name}(self):
    return {expr}

@{name}.setter
def {name}(self, value):
    if value != self.{name}:
        raise ValueError(f"config.{name}={{value}} disagrees with what the configuration holds ({expr}={{self.{name}}})")
"""


def _with_sizes(node: cst.ClassDef, sizes: tuple[tuple[str, str], ...]) -> cst.ClassDef:
    """The class with a property for each of ``sizes``: vLLM reads them under these names."""
    if not sizes:
        return node
    comment = "# what vLLM reads to size the model, from the fields this configuration holds it in"
    added = []
    for name, expr in sizes:
        added += cst.parse_module(_SIZE.format(name=name, expr=expr)).body
    added[0] = added[0].with_changes(
        leading_lines=[cst.EmptyLine(), cst.EmptyLine(comment=cst.Comment(comment))]
    )
    return node.with_changes(body=node.body.with_changes(body=[*node.body.body, *added]))


def with_shim(module: cst.Module, statements: list[cst.CSTNode]) -> cst.Module:
    """``module`` with ``statements`` after its imports (their imports join the file's)."""
    imports = [n for n in statements if _is_import(n)]
    rest = [n for n in statements if not _is_import(n)]
    body = list(module.body)
    at = max((i + 1 for i, n in enumerate(body) if _is_import(n)), default=0)
    return module.with_changes(body=[*body[:at], *imports, *rest, *body[at:]])


def _is_import(node: cst.CSTNode) -> bool:
    return isinstance(node, cst.SimpleStatementLine) and isinstance(node.body[0], cst.Import | cst.ImportFrom)


def _is_docstring(node: cst.CSTNode) -> bool:
    return (
        isinstance(node, cst.SimpleStatementLine)
        and isinstance(node.body[0], cst.Expr)
        and isinstance(node.body[0].value, cst.SimpleString | cst.ConcatenatedString)
    )


def shim_classes(text: str) -> dict[str, str]:
    """model type -> class name of the config shims a generated file defines."""
    found = {}
    for node in ast.parse(text).body:
        if not isinstance(node, ast.ClassDef) or SHIM_NOTE not in (ast.get_docstring(node) or ""):
            continue
        for stmt in node.body:
            if (
                isinstance(stmt, ast.Assign)
                and [getattr(t, "id", None) for t in stmt.targets] == ["model_type"]
                and isinstance(stmt.value, ast.Constant)
            ):
                found[stmt.value.value] = node.name
    return found
