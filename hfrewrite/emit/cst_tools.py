"""Small libcst helpers shared by the passes: find, replace and build nodes."""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterator

import libcst as cst
import libcst.matchers as m

from hfrewrite.errors import HfrewriteError

_EMPTY = cst.Module(body=[])


def code(node: cst.CSTNode) -> str:
    """Source text of a node."""
    return _EMPTY.code_for_node(node)


def stmt(src: str) -> cst.BaseStatement:
    return cst.parse_statement(src)


def stmts(src: str) -> list[cst.BaseStatement]:
    """Parse statements; comment lines at the very top stay on the first statement."""
    module = cst.parse_module(src)
    body = list(module.body)
    comments = [line for line in module.header if line.comment is not None]
    if comments and body:
        body[0] = body[0].with_changes(leading_lines=[*comments, *body[0].leading_lines])
    return body


def expr(src: str) -> cst.BaseExpression:
    return cst.parse_expression(src)


def find_class(module: cst.Module, name: str) -> cst.ClassDef:
    for node in module.body:
        if isinstance(node, cst.ClassDef) and node.name.value == name:
            return node
    raise HfrewriteError(f"class {name} not found in the modeling source")


def replace_class(module: cst.Module, name: str, new: cst.ClassDef) -> cst.Module:
    body = [new if isinstance(n, cst.ClassDef) and n.name.value == name else n for n in module.body]
    return module.with_changes(body=body)


def find_method(cls: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    for node in cls.body.body:
        if isinstance(node, cst.FunctionDef) and node.name.value == name:
            return node
    return None


def set_method(cls: cst.ClassDef, fn: cst.FunctionDef) -> cst.ClassDef:
    """Replace the method of the same name, or append it."""
    name = fn.name.value
    body = list(cls.body.body)
    for i, node in enumerate(body):
        if isinstance(node, cst.FunctionDef) and node.name.value == name:
            body[i] = fn.with_changes(leading_lines=node.leading_lines, decorators=fn.decorators)
            return cls.with_changes(body=cls.body.with_changes(body=body))
    body.append(fn.with_changes(leading_lines=[cst.EmptyLine()]))
    return cls.with_changes(body=cls.body.with_changes(body=body))


def with_params(fn: cst.FunctionDef, params: list[str]) -> cst.FunctionDef:
    """``fn`` with more parameters (source text, e.g. ``"prefix: str = ''"``) after its own."""
    if not params:
        return fn
    new = stmt(f"def f(self, {', '.join(params)}):\n    pass\n").params.params[1:]
    return fn.with_changes(params=fn.params.with_changes(params=[*fn.params.params, *new]))


def with_body(fn: cst.FunctionDef, body: list[cst.BaseStatement]) -> cst.FunctionDef:
    return fn.with_changes(body=fn.body.with_changes(body=body))


def self_attr_assigned(node: cst.BaseStatement) -> str | None:
    """'x' for a statement `self.x = ...` (or `self.x: T = ...`), else None."""
    if not isinstance(node, cst.SimpleStatementLine) or len(node.body) != 1:
        return None
    small = node.body[0]
    if isinstance(small, cst.Assign) and len(small.targets) == 1:
        target = small.targets[0].target
    elif isinstance(small, cst.AnnAssign):
        target = small.target
    else:
        return None
    if (
        isinstance(target, cst.Attribute)
        and isinstance(target.value, cst.Name)
        and target.value.value == "self"
    ):
        return target.attr.value
    return None


def init_assignments(cls: cst.ClassDef, attrs: tuple[str, ...], who: str):
    """(``__init__``, its statements, {attr: index}) for a class whose ``__init__`` assigns
    every one of ``attrs``; raises naming ``who`` (the pass) otherwise."""
    init = find_method(cls, "__init__")
    body = list(init.body.body) if init else []
    where = {self_attr_assigned(s): i for i, s in enumerate(body)}
    missing = [a for a in attrs if a not in where]
    if missing:
        raise HfrewriteError(f"{cls.name.value}: {who}: {'/'.join(missing)} not assigned in __init__")
    return init, body, where


def assigned_value(node: cst.BaseStatement) -> cst.BaseExpression:
    small = node.body[0]  # type: ignore[attr-defined]
    return small.value


def call_name(node: cst.BaseExpression) -> str | None:
    """Dotted name of a call's function: 'nn.Linear', 'LlamaRMSNorm', 'self.q_proj'."""
    if not isinstance(node, cst.Call):
        return None
    return dotted(node.func)


def dotted(node: cst.BaseExpression) -> str | None:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


def arg(call: cst.Call, position: int, keyword: str) -> cst.BaseExpression | None:
    """The argument given by keyword or at a position (keywords win)."""
    for a in call.args:
        if a.keyword is not None and a.keyword.value == keyword:
            return a.value
    positional = [a for a in call.args if a.keyword is None and not a.star]
    return positional[position].value if position < len(positional) else None


def linear_args(call: cst.Call) -> tuple[cst.BaseExpression | None, ...]:
    """``nn.Linear(in_features, out_features, bias)``'s arguments as given (None: the default)."""
    return arg(call, 0, "in_features"), arg(call, 1, "out_features"), arg(call, 2, "bias")


def leading_comments(node: cst.BaseStatement) -> list[cst.EmptyLine]:
    """The comment lines above a statement (blank lines dropped)."""
    lines = getattr(node, "leading_lines", ())
    return [line for line in lines if line.comment is not None]


class _Names(cst.CSTVisitor):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Name(self, node: cst.Name) -> None:
        self.names.add(node.value)


_FIELDS: dict[type, tuple[str, ...]] = {}
_IS_NODE: dict[type, bool] = {}  # isinstance on CSTNode (an ABC) is slow: cached per type


def _is_node(value: object) -> bool:
    kind = type(value)
    known = _IS_NODE.get(kind)
    if known is None:
        known = _IS_NODE[kind] = issubclass(kind, cst.CSTNode)
    return known


def children(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """A node's child nodes, read from its fields. Unlike ``node.visit``, which rebuilds
    (and revalidates) every node it passes, this only reads: for analyses, not rewrites."""
    names = _FIELDS.get(type(node))
    if names is None:
        names = _FIELDS[type(node)] = tuple(f.name for f in dataclasses.fields(node))
    for name in names:
        value = getattr(node, name)
        if type(value) in (list, tuple):
            yield from (item for item in value if _is_node(item))
        elif _is_node(value):
            yield value


def walk(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """``node`` and every node below it (pre-order), read-only."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(children(current))


def names_used(node: cst.CSTNode) -> set[str]:
    """Every ``Name`` below ``node`` (attribute names included)."""
    return {n.value for n in walk(node) if isinstance(n, cst.Name)}


def plain_names(node: cst.CSTNode) -> set[str]:
    """The names below ``node`` used as variables: not attribute names (``x.name``) nor
    keywords (``f(name=...)``)."""
    skip = {id(n.attr) for n in walk(node) if isinstance(n, cst.Attribute)}
    skip |= {id(n.keyword) for n in walk(node) if isinstance(n, cst.Arg) and n.keyword is not None}
    return {n.value for n in walk(node) if isinstance(n, cst.Name) and id(n) not in skip}


class _RenameLocals(cst.CSTTransformer):
    def __init__(self, mapping: dict[str, str]) -> None:
        self.mapping = mapping

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        return False  # only the object is renamed: `x.q` keeps its attribute name

    def leave_Attribute(self, original, updated):
        return updated.with_changes(value=original.value.visit(self))

    def leave_Arg(self, original, updated):
        return updated.with_changes(keyword=original.keyword)  # `f(q=...)` keeps its keyword

    def leave_Name(self, original, updated):
        new = self.mapping.get(updated.value, updated.value)
        return new if isinstance(new, cst.BaseExpression) else updated.with_changes(value=new)


def rename_locals(fn: cst.FunctionDef, mapping: dict[str, str]) -> cst.FunctionDef:
    """``fn`` with its local names renamed (``mapping``); attribute names and call keywords
    keep theirs. The caller makes sure they are locals (not parameters, globals or closures)."""
    return fn.with_changes(body=fn.body.visit(_RenameLocals(mapping)))


def replace_names(node: cst.CSTNode, mapping: dict[str, str | cst.BaseExpression]) -> cst.CSTNode:
    """``node`` with each name in ``mapping`` renamed (a string) or replaced (an expression);
    attribute names and call keywords keep theirs."""
    return node.visit(_RenameLocals(mapping))


def direct_calls(module: cst.Module) -> dict[str, list[cst.Call]]:
    """Names used only as the callee of calls (``Name(...)``), with those calls.

    A name also referenced any other way (a base class, a value, a rebinding, an import)
    is left out; definition names, attribute names, keywords, parameters and the class
    argument of ``isinstance`` are not references."""
    not_refs: set[int] = set()
    calls: dict[str, list[cst.Call]] = {}
    names: list[cst.Name] = []
    for node in walk(module):
        if isinstance(node, cst.Name):
            names.append(node)
        elif isinstance(node, (cst.ClassDef, cst.FunctionDef, cst.Param)):
            not_refs.add(id(node.name))
        elif isinstance(node, cst.Attribute):
            not_refs.add(id(node.attr))
        elif isinstance(node, cst.Arg) and node.keyword is not None:
            not_refs.add(id(node.keyword))
        elif isinstance(node, cst.Call) and isinstance(node.func, cst.Name):
            not_refs.add(id(node.func))
            calls.setdefault(node.func.value, []).append(node)
            if node.func.value == "isinstance" and len(node.args) == 2:
                kinds = node.args[1].value
                elements = kinds.elements if isinstance(kinds, cst.Tuple) else [kinds]
                not_refs.update(id(e.value if isinstance(e, cst.Element) else e) for e in elements)
    other = {n.value for n in names if id(n) not in not_refs}
    return {name: found for name, found in calls.items() if name not in other}


def callable_defs(module: cst.Module) -> dict[str, cst.FunctionDef]:
    """Top-level functions and class ``__init__``s by the name they are called with."""
    defs: dict[str, cst.FunctionDef] = {}
    for node in module.body:
        if isinstance(node, cst.FunctionDef):
            defs[node.name.value] = node
        elif isinstance(node, cst.ClassDef) and (init := find_method(node, "__init__")):
            defs[node.name.value] = init
    return defs


def positional_params(fn: cst.FunctionDef, is_init: bool) -> list[str]:
    """Parameters a call can bind by position (``self`` left out of an ``__init__``)."""
    names = [p.name.value for p in fn.params.params]
    return names[1:] if is_init else names


def bound_arg(call: cst.Call, fn: cst.FunctionDef, is_init: bool, param: str) -> int | None:
    """Index in ``call.args`` of the argument bound to ``param`` of ``fn``: -1 when the
    call passes none (the default applies), None when unpacking hides it."""
    if any(a.star for a in call.args):
        return None
    for i, a in enumerate(call.args):
        if a.keyword is not None and a.keyword.value == param:
            return i
    names = positional_params(fn, is_init)
    positional = [i for i, a in enumerate(call.args) if a.keyword is None]
    if param in names and names.index(param) < len(positional):
        return positional[names.index(param)]
    return -1


class _RootNames(_Names):
    def visit_Attribute(self, node: cst.Attribute) -> bool:
        node.value.visit(self)  # `a.b.c` reads a, not b or c
        return False

    def visit_Arg(self, node: cst.Arg) -> bool:
        node.value.visit(self)  # `f(p=x)` reads x, not p
        return False


def root_names(node: cst.CSTNode) -> set[str]:
    """Names read or bound as variables (``None`` and the like included), not attribute names."""
    visitor = _RootNames()
    node.visit(visitor)
    return visitor.names


class _SelfAttrs(cst.CSTVisitor):
    def __init__(self) -> None:
        self.attrs: set[str] = set()

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if isinstance(node.value, cst.Name) and node.value.value == "self":
            self.attrs.add(node.attr.value)


def self_attrs_used(node: cst.CSTNode) -> set[str]:
    visitor = _SelfAttrs()
    node.visit(visitor)
    return visitor.attrs


def without_unused_methods(cls: cst.ClassDef) -> cst.ClassDef:
    """``cls`` without the methods that ``__init__``, ``forward`` and the methods they call
    no longer reach through ``self.<name>`` (helpers of a rewritten forward)."""
    methods = {s.name.value: s for s in cls.body.body if isinstance(s, cst.FunctionDef)}
    kept, todo = set(), ["__init__", "forward"]
    while todo:
        name = todo.pop()
        if name in methods and name not in kept:
            kept.add(name)
            todo.extend(self_attrs_used(methods[name]))
    members = [s for s in cls.body.body if not (isinstance(s, cst.FunctionDef) and s.name.value not in kept)]
    return cls.with_changes(body=cls.body.with_changes(body=members))


def branch_guards(branches, init_exprs: dict[str, str], cls: str, what: str, skip: str | None = None) -> str:
    """Statements refusing configs on which a config switch takes another branch than the
    traced one: each ``(test, outcome)`` with ``self.<attr>`` replaced by the expression
    ``__init__`` assigns it (``self.config`` -> ``config``); a test equal to ``skip`` (a
    switch the emitted code carries, such as a renormalisation flag) is left out. Raises
    ValueError for a test on an attribute ``__init__`` does not assign."""
    out = ""
    for test, outcome in branches:
        expr = config_test(test, init_exprs)
        if skip and _same_test(expr, skip):
            continue
        shown = expr.replace('"', "'")
        out += (
            f"if {'not ' if outcome else ''}({expr}):\n"
            f'    raise NotImplementedError("hfrewrite: {cls} was converted for configs where '
            f'`{shown}` is {outcome}: its {what} takes another branch here")\n'
        )
    return out


def config_test(test: str, init_exprs: dict[str, str]) -> str:
    """A forward's test on ``self.<attr>`` as ``__init__`` can evaluate it: each attribute
    replaced by the expression ``__init__`` assigns it (``self.config`` -> ``config``).
    Raises ValueError for a test on an attribute ``__init__`` does not assign."""
    expr = test
    for attr, source in init_exprs.items():
        expr = re.sub(rf"\bself\.{attr}\b", source, expr)
    if "self." in expr:
        raise ValueError(test)
    return expr


def guards_first(body: list[cst.BaseStatement], guards: str) -> list[cst.BaseStatement]:
    """``body`` (an ``__init__``'s) with ``guards`` (statements reading only ``config``)
    right after ``super().__init__()``: a config the file refuses is refused before any
    layer is built, with hfrewrite's message."""
    if not guards:
        return body
    at = next((i + 1 for i, s in enumerate(body) if m.matches(s, _SUPER_INIT)), 0)
    # a vLLM-side __init__ takes its config from vllm_config first: the guards read it
    at = next((i + 1 for i, s in enumerate(body) if m.matches(s, _CONFIG_ASSIGNED)), at)
    return [*body[:at], *stmts(guards), *body[at:]]


_SUPER_INIT = m.SimpleStatementLine(
    body=[m.Expr(m.Call(func=m.Attribute(value=m.Call(func=m.Name("super")), attr=m.Name("__init__"))))]
)


_CONFIG_ASSIGNED = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name("config"))])])


def _same_test(test: str, carried: str) -> bool:
    """Whether ``test`` is, as a syntax tree, the carried condition or one operand of its
    ``and``/``or`` (``config.norm_topk`` is not part of ``config.norm_topk_prob``)."""
    tree = ast.parse(test, mode="eval").body
    whole = ast.parse(carried, mode="eval").body
    operands = [whole, *(whole.values if isinstance(whole, ast.BoolOp) else ())]
    return any(ast.dump(tree) == ast.dump(op) for op in operands)


def init_exprs(cls: cst.ClassDef) -> dict[str, str]:
    """`self.x = expr` in ``cls.__init__`` -> {"x": "expr"}."""
    return {
        attr: code(assigned_value(s))
        for s in find_method(cls, "__init__").body.body
        if (attr := self_attr_assigned(s))
    }


def resolved_self(expression: str, exprs: dict[str, str]) -> str:
    """``expression`` with each ``self.x`` that ``exprs`` (``init_exprs``) defines replaced,
    transitively, by its parenthesised expression: ``nn.Linear(self.hidden_dim, ...)``'s
    ``self.hidden_dim`` -> ``config.hidden_size``."""

    class _Resolve(cst.CSTTransformer):
        def leave_Attribute(self, original, updated):
            if m.matches(updated, m.Attribute(value=m.Name("self"))) and updated.attr.value in exprs:
                value = expr(exprs[updated.attr.value])
                atomic = isinstance(value, cst.Name | cst.Attribute | cst.Integer | cst.Subscript | cst.Call)
                return (
                    value if atomic else value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
                )
            return updated

    for _ in range(len(exprs) + 1):
        again = code(expr(expression).visit(_Resolve()))
        if again == expression:
            break
        expression = again
    return expression


def guarded_divisions(node: cst.CSTNode, divisor) -> list[tuple[str, cst.BaseExpression]]:
    """Each ``x / d`` or ``x /= d`` in ``node`` whose ``d`` passes ``divisor``: the tests of
    the ``if`` statements around it joined by ``and`` ("True" when none), each negated where
    the division is in its ``else`` or ``elif`` branch, and ``d``."""
    found: list[tuple[str, cst.BaseExpression]] = []

    class _Find(cst.CSTVisitor):
        def __init__(self) -> None:
            self.conditions: list[str] = []

        def visit_If_body(self, node: cst.If) -> None:
            self.conditions.append(code(node.test))

        def leave_If_body(self, node: cst.If) -> None:
            self.conditions.pop()

        def visit_If_orelse(self, node: cst.If) -> None:
            self.conditions.append(f"not ({code(node.test)})")

        def leave_If_orelse(self, node: cst.If) -> None:
            self.conditions.pop()

        def _found(self, d: cst.BaseExpression) -> None:
            if divisor(d):
                found.append((" and ".join(self.conditions) or "True", d))

        def visit_AugAssign(self, node: cst.AugAssign) -> None:
            if isinstance(node.operator, cst.DivideAssign):
                self._found(node.value)

        def visit_BinaryOperation(self, node: cst.BinaryOperation) -> None:
            if isinstance(node.operator, cst.Divide):
                self._found(node.right)

    node.visit(_Find())
    return found


def bound_names(node: cst.CSTNode) -> set[str]:
    """The names a top-level statement binds: a class or function, plain assignment targets,
    what an import binds (``import a.b`` binds ``a``)."""
    if isinstance(node, cst.ClassDef | cst.FunctionDef):
        return {node.name.value}
    if not isinstance(node, cst.SimpleStatementLine):
        return set()
    names: set[str] = set()
    for small in node.body:
        if isinstance(small, cst.Import | cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
            names |= {code(a.asname.name if a.asname else a.name).split(".")[0] for a in small.names}
        elif isinstance(small, cst.Assign | cst.AnnAssign):
            targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
            names |= {t.value for t in targets if isinstance(t, cst.Name)}
    return names


def top_level_names(module: cst.Module) -> set[str]:
    """Names a module binds at its top level by assignment or import."""
    return set().union(*(bound_names(n) for n in module.body if isinstance(n, cst.SimpleStatementLine)))
