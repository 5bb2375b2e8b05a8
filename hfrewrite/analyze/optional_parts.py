"""Optional parts: a submodule ``__init__`` builds under a config test, ``None`` otherwise.

Granite-4.0's decoder layer::

    self.mamba = None
    if config.layers_block_type[layer_idx] == "linear_attention":
        self.mamba = GraniteMoeHybridMambaLayer(config, layer_idx)

(or ``self.part = Part(...) if <test> else None``): its forward's ``if self.mamba is not
None:`` is then the config switch ``<test>``, and ``self.mamba is None`` its negation. The
rewrite is read from the ``__init__``'s statements alone: the attribute is assigned ``None``
once at the top level, then once more, a call (a part built, never None), inside the body
(or else) of one later top-level ``if``; any other assignment leaves the attribute out
(Cohere2's ``config.sliding_window if <kind> else None`` may be None either way).
"""

from __future__ import annotations

import ast
import copy

_READABLE = {"getattr", "hasattr", "len", "isinstance", "None", "True", "False"}


def optional_parts(init: ast.FunctionDef) -> dict[str, ast.expr]:
    """{attribute: the config test under which ``init`` builds it (not None)}; a test reading
    anything but ``init``'s parameters and builtins (a local it computed) is left out."""
    params = {a.arg for a in (*init.args.posonlyargs, *init.args.args, *init.args.kwonlyargs)}
    found = _optional_parts(init)
    return {
        attr: test
        for attr, test in found.items()
        if {n.id for n in ast.walk(test) if isinstance(n, ast.Name)} <= (params - {"self"}) | _READABLE
    }


def _optional_parts(init: ast.FunctionDef) -> dict[str, ast.expr]:
    counts = self_assignments(init)
    found: dict[str, ast.expr] = {}
    nulled: set[str] = set()
    for statement in init.body:
        attr, value = _assigned(statement)
        if attr and _is_none(value) and counts[attr] == 2:
            nulled.add(attr)
        elif attr and isinstance(value, ast.IfExp) and counts[attr] == 1:
            if _is_none(value.orelse) and isinstance(value.body, ast.Call):
                found[attr] = value.test
            elif _is_none(value.body) and isinstance(value.orelse, ast.Call):
                found[attr] = negated(value.test)
        elif isinstance(statement, ast.If):
            for side, test in ((statement.body, statement.test), (statement.orelse, negated(statement.test))):
                for inner in side:
                    attr, value = _assigned(inner)
                    if attr in nulled and attr not in found and isinstance(value, ast.Call):
                        found[attr] = test
    return found


class AsConfigTest(ast.NodeTransformer):
    """``self.<part> is not None`` -> its test; ``self.<part> is None`` -> the negation."""

    def __init__(self, parts: dict[str, ast.expr]) -> None:
        self.parts = parts

    def visit_Compare(self, node: ast.Compare):
        node = self.generic_visit(node)
        if not (len(node.ops) == 1 and _is_none(node.comparators[0]) and _self_attr(node.left)):
            return node
        test = self.parts.get(node.left.attr)
        if test is None or not isinstance(node.ops[0], ast.Is | ast.IsNot):
            return node
        test = copy.deepcopy(test)
        return test if isinstance(node.ops[0], ast.IsNot) else negated(test)


def optional_tests(init_source: str):
    """A function taking a test (source) to the same with the optional parts of the
    ``__init__`` in ``init_source`` as their config tests (``__init__`` parsed once)."""
    tree = ast.parse(init_source.strip() + "\n") if init_source else None
    init = tree.body[0] if tree is not None and tree.body else None
    parts = optional_parts(init) if isinstance(init, ast.FunctionDef) else {}

    def rewritten(test: str) -> str:
        return ast.unparse(AsConfigTest(parts).visit(ast.parse(test, mode="eval"))) if parts else test

    return rewritten


def self_assignments(tree: ast.AST) -> dict[str, int]:
    """{attribute: how many statements below ``tree`` assign ``self.<attribute>``}."""
    counts: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if _self_attr(target):
                    counts[target.attr] = counts.get(target.attr, 0) + 1
    return counts


def _assigned(statement: ast.stmt) -> tuple[str | None, ast.expr | None]:
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and _self_attr(statement.targets[0]):
        return statement.targets[0].attr, statement.value
    if isinstance(statement, ast.AnnAssign) and _self_attr(statement.target) and statement.value is not None:
        return statement.target.attr, statement.value
    return None, None


def _self_attr(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def _is_none(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def negated(test: ast.expr) -> ast.expr:
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return test.operand
    return ast.UnaryOp(op=ast.Not(), operand=test)
