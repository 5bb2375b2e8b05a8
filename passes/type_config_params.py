"""Annotate parameters that receive the model's configuration with its class.

Matches an unannotated parameter of a top-level function or class ``__init__`` that every
call in the module passes the model configuration: a name bound to
``vllm_config.model_config.hf_config`` (what vLLM hands the model: an instance of the
configuration class the analysis built the model from, ``ModelPlan.config_class``), or to
a parameter proven the same way (the source's own annotations are not taken as proof). Repeats until nothing changes, so
``config`` is followed from the model through the decoder layer into its attention and MLP.

Emits ``config: Qwen3Config`` where the source had ``config``; for Hub custom code, whose
configuration class only the repository defines (vLLM loads it with ``trust_remote_code``),
``config: PretrainedConfig``, its base.

Preconditions (otherwise the parameter stays as it is): the class is imported in the
module (custom code: ``PretrainedConfig`` is imported when used); the callee is referenced
only by direct calls, or as an entry of a module-level table of classes that is only indexed
and called (Jamba's ``ALL_DECODER_LAYER_TYPES[...](config, ...)``: a call of each entry);
every call passes the argument (no default fills it) as a plain name, not rebound in the
calling function.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pass_api import PassContext, PassResult

NAME = "type_config_params"
HF_CONFIG = "vllm_config.model_config.hf_config"


def _imported(module: cst.Module, name: str) -> bool:
    for node in module.body:
        if isinstance(node, cst.SimpleStatementLine) and isinstance(node.body[0], cst.ImportFrom):
            names = node.body[0].names
            if not isinstance(names, cst.ImportStar) and any(
                (a.evaluated_alias or a.evaluated_name) == name for a in names
            ):
                return True
    return False


def _all_calls(
    module: cst.Module,
) -> list[tuple[cst.FunctionDef | None, cst.Call, set[str]]]:
    """Every call with its innermost enclosing function and the names lambdas around it
    rebind."""
    found = []

    def visit(node: cst.CSTNode, fn: cst.FunctionDef | None, shadowed: frozenset[str]) -> None:
        if isinstance(node, cst.FunctionDef):
            fn, shadowed = node, frozenset()
        elif isinstance(node, cst.Lambda):
            shadowed = shadowed | {p.name.value for p in node.params.params}
        elif isinstance(node, cst.Call):
            found.append((fn, node, set(shadowed)))
        for child in t.children(node):
            visit(child, fn, shadowed)

    visit(module, None, frozenset())
    return found


def _assignments(fn: cst.FunctionDef) -> dict[str, list[str]]:
    """Name -> the code of every value assigned to it anywhere in ``fn``."""
    values: dict[str, list[str]] = {}
    for node in t.walk(fn.body):
        targets = []
        if isinstance(node, cst.Assign):
            targets = [(a.target, node.value) for a in node.targets]
        elif isinstance(node, (cst.AnnAssign, cst.AugAssign)):
            targets = [(node.target, node.value)]
        elif isinstance(node, (cst.For, cst.With, cst.NamedExpr)):
            targets = [(n, None) for n in t.walk(node) if isinstance(n, cst.Name)]
        for target, value in targets:
            if isinstance(target, cst.Name):
                values.setdefault(target.value, []).append(t.code(value) if value else "?")
    return values


def _typed(module: cst.Module, config_class: str) -> dict[str, set[str]]:
    """Callee -> its parameters that receive the model configuration (fixpoint)."""
    defs = t.callable_defs(module)
    tables = _class_tables(module)
    # a class named in a table is called through it: its entry is no other use (the table left
    # out, and a call of each of its classes put in its place)
    body = [n for n in module.body if id(n) not in tables.ids]
    calls = [t.stmt(f"{cls}()\n") for classes in tables.classes.values() for cls in classes]
    direct = t.direct_calls(module.with_changes(body=[*body, *calls]))
    caller_of = {id(fn): name for name, fn in defs.items()}
    typed: dict[str, set[str]] = {name: set() for name in defs}  # proven by the flow only
    assigned = {name: _assignments(fn) for name, fn in defs.items()}
    params_of = {name: {p.name.value for p in _params(fn)} for name, fn in defs.items()}
    calls_of: dict[str, list[tuple[str | None, cst.Call, set[str]]]] = {}
    for fn, call, shadowed in _all_calls(module):
        caller = caller_of.get(id(fn)) if fn is not None else None
        if isinstance(call.func, cst.Name):
            calls_of.setdefault(call.func.value, []).append((caller, call, shadowed))
        elif m.matches(call.func, m.Subscript(value=m.Name())):  # `TABLE[key](...)`: each class of it
            for cls in tables.classes.get(call.func.value.value, ()):
                calls_of.setdefault(cls, []).append((caller, call, shadowed))

    def is_config(arg: cst.BaseExpression, caller: str | None, shadowed: set[str]) -> bool:
        if caller is None or not isinstance(arg, cst.Name) or arg.value in shadowed:
            return False
        name, values = arg.value, assigned[caller].get(arg.value, [])
        if name in params_of[caller]:
            return not values and name in typed[caller]
        return values == [HF_CONFIG]

    changed = True
    while changed:
        changed = False
        for callee, fn in defs.items():
            calls = calls_of.get(callee, [])
            if callee not in direct or not calls:
                continue
            is_init = fn.name.value == "__init__"
            for p in _params(fn):
                name = p.name.value
                if name in typed[callee]:
                    continue
                at = [t.bound_arg(call, fn, is_init, name) for _, call, _ in calls]
                if all(
                    i is not None and i >= 0 and is_config(call.args[i].value, caller, shadowed)
                    for i, (caller, call, shadowed) in zip(at, calls)
                ):
                    typed[callee].add(name)
                    changed = True
    return typed


@dataclass(frozen=True)
class _Tables:
    classes: dict[str, tuple[str, ...]]  # module-level dicts of names -> those names (Jamba's
    ids: set[int]  # ALL_DECODER_LAYER_TYPES, which make_layers' lambda indexes and calls)


def _class_tables(module: cst.Module) -> _Tables:
    """The module's ``NAME = {key: Name, ...}`` statements, read only as ``NAME[...](...)``."""
    classes, ids = {}, set()
    for node in module.body:
        one = node.body[0] if isinstance(node, cst.SimpleStatementLine) and len(node.body) == 1 else None
        if (
            isinstance(one, cst.Assign)
            and len(one.targets) == 1
            and isinstance(one.targets[0].target, cst.Name)
            and isinstance(one.value, cst.Dict)
            and one.value.elements
            and all(
                isinstance(e, cst.DictElement) and isinstance(e.value, cst.Name) for e in one.value.elements
            )
        ):
            name = one.targets[0].target.value
            uses = [n for n in t.walk(module) if isinstance(n, cst.Name) and n.value == name]
            called = [
                n
                for n in t.walk(module)
                if isinstance(n, cst.Call) and m.matches(n.func, m.Subscript(value=m.Name(name)))
            ]
            if len(uses) == len(called) + 1:  # its definition, and each use an indexed call
                classes[name] = tuple(e.value.value for e in one.value.elements)
                ids.add(id(node))
    return _Tables(classes, ids)


def _params(fn: cst.FunctionDef) -> list[cst.Param]:
    return [*fn.params.params, *fn.params.kwonly_params]


class _Annotate(cst.CSTTransformer):
    def __init__(self, targets: dict[int, set[str]], config_class: str) -> None:
        self.targets, self.config_class = targets, config_class
        self.count = 0

    def leave_FunctionDef(self, original, updated):
        names = self.targets.get(id(original))
        if not names:
            return updated

        def annotate(p: cst.Param) -> cst.Param:
            if p.name.value not in names or p.annotation is not None:
                return p
            self.count += 1
            return p.with_changes(annotation=cst.Annotation(cst.Name(self.config_class)))

        params = updated.params
        return updated.with_changes(
            params=params.with_changes(
                params=[annotate(p) for p in params.params],
                kwonly_params=[annotate(p) for p in params.kwonly_params],
            )
        )


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    # custom code: the repository's class is not importable from the file; its base is
    config_class = "PretrainedConfig" if ctx.custom_code else ctx.plan.config_class
    if not config_class or not (ctx.custom_code or _imported(module, config_class)):
        return PassResult(module=module)
    typed = _typed(module, config_class)
    defs = t.callable_defs(module)
    targets = {id(fn): typed[name] for name, fn in defs.items() if typed[name]}
    annotate = _Annotate(targets, config_class)
    module = module.visit(annotate)
    imports = ("PretrainedConfig",) if ctx.custom_code and annotate.count else ()
    return PassResult(module=module, imports=imports, matches=annotate.count)
