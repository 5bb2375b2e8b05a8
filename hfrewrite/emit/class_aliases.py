"""A local name bound to a class by literals alone, written as the class it names.

Bamba's layer picks its feed-forward class as ``num_experts = 1`` then
``ffn_layer_class = BambaMLP if num_experts == 1 else None`` and builds
``self.feed_forward = ffn_layer_class(config)``: the alias always names ``BambaMLP``, and
passes that find a layer's parts by their class (threading ``quant_config`` and ``prefix``,
typing the config) must see ``BambaMLP(config)``."""

from __future__ import annotations

import ast

import libcst as cst

from hfrewrite.emit import cst_tools as t


def folded_class_aliases(
    fn: cst.FunctionDef, classes: frozenset[str] | set[str] = frozenset()
) -> cst.FunctionDef:
    """``fn`` with each alias chosen by literal locals replaced by its class where called,
    and each alias choosing between two of ``classes`` (the file's own) by another test
    replaced by that choice between their calls; the alias and the literals no longer read
    dropped."""
    literals: dict[str, object] = {}
    aliases: dict[str, str] = {}
    dropped: set[int] = set()
    body = list(fn.body.body)
    for i, statement in enumerate(body):
        one = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        if not (
            isinstance(one, cst.Assign)
            and len(one.targets) == 1
            and isinstance(one.targets[0].target, cst.Name)
        ):
            continue
        name = one.targets[0].target.value
        try:
            literals[name] = ast.literal_eval(t.code(one.value))
            continue
        except (ValueError, SyntaxError):
            pass
        chosen = _chosen(one.value, literals) or _either(one.value, body[i + 1 :], classes)
        if chosen is not None:
            aliases[name] = chosen
            dropped.add(i)
    if not aliases:
        return fn
    renamed = t.with_body(fn, [s for i, s in enumerate(body) if i not in dropped]).visit(_Called(aliases))
    if t.root_names(renamed.body) & set(aliases):  # read otherwise than called: left as it was
        return fn

    def literal(s: cst.BaseStatement) -> bool:
        one = s.body[0] if isinstance(s, cst.SimpleStatementLine) else None
        return isinstance(one, cst.Assign) and t.dotted(one.targets[0].target) in literals

    read = t.root_names(cst.Module([s for s in renamed.body.body if not literal(s)]))
    kept = [
        s for s in renamed.body.body if not (literal(s) and t.dotted(s.body[0].targets[0].target) not in read)
    ]
    return t.with_body(renamed, kept)


def _chosen(value: cst.BaseExpression, literals: dict[str, object]) -> str | None:
    """The class name ``A if <test on literals> else B`` evaluates to, else None."""
    if not isinstance(value, cst.IfExp):
        return None
    test = ast.parse(t.code(value.test).strip(), mode="eval")
    if {n.id for n in ast.walk(test) if isinstance(n, ast.Name)} - set(literals):
        return None
    taken = (
        value.body
        if eval(compile(test, "<alias>", "eval"), {"__builtins__": {}}, dict(literals))
        else value.orelse
    )
    return taken.value if isinstance(taken, cst.Name) and taken.value != "None" else None


def _either(value: cst.BaseExpression, after: list[cst.BaseStatement], classes) -> cst.IfExp | None:
    """``A if <test> else B`` of two of ``classes`` whose test reads names no later statement
    assigns (Jamba's ``JambaSparseMoeBlock if num_experts > 1 else JambaMLP``): each call of
    the alias may be written ``A(...) if <test> else B(...)``. Else None."""
    if not (
        isinstance(value, cst.IfExp)
        and isinstance(value.body, cst.Name)
        and isinstance(value.orelse, cst.Name)
        and {value.body.value, value.orelse.value} <= set(classes)
    ):
        return None
    assigned = {
        t.dotted(target.target)
        for statement in after
        for assign in ([statement.body[0]] if isinstance(statement, cst.SimpleStatementLine) else [])
        if isinstance(assign, cst.Assign)
        for target in assign.targets
    }
    return None if t.root_names(value.test) & assigned else value


class _Called(cst.CSTTransformer):
    """Each call of an alias as its class, or as the choice of either class's call."""

    def __init__(self, aliases: dict[str, str | cst.IfExp]) -> None:
        self.aliases = aliases

    def leave_Call(self, original, updated):
        chosen = self.aliases.get(updated.func.value) if isinstance(updated.func, cst.Name) else None
        if isinstance(chosen, str):
            return updated.with_changes(func=cst.Name(chosen))
        if chosen is not None:
            return chosen.with_changes(
                body=updated.with_changes(func=chosen.body), orelse=updated.with_changes(func=chosen.orelse)
            )
        return updated
