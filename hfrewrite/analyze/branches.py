"""Config switches in a module's forward: which branch the traced config took.

The trace proves the branch it ran; a converted file that drops the others must refuse
configs that would take them. Each ``if``/``elif`` test that reads only the module's own
attributes and constants (``self.topk_method == "greedy"``, ``self.config.rope_interleave``)
is evaluated on the traced module; tests on tensors or arguments are not config switches.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Literal

from torch import nn

from hfrewrite.analyze.layer_classes import one_per_class
from hfrewrite.analyze.optional_parts import AsConfigTest, optional_parts, self_assignments

# which methods' switches: forward and __init__, one of them, or the forward's helpers
Part = Literal["both", "forward", "init", "helpers"]


def method_tree(cls: type, method: str) -> ast.Module | None:
    """The parsed source of ``cls.<method>``; None where Python keeps none (a builtin, a
    class defined in a REPL)."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, method))))
    except (OSError, TypeError, SyntaxError):
        return None


def config_branches(module: nn.Module, method: str = "forward") -> tuple[tuple[str, bool], ...]:
    """(test source, value on the traced module) for each config switch of ``method``; an
    ``elif`` after a branch taken is unreachable and left out."""
    tree = method_tree(type(module), method)
    if tree is None:
        return ()
    found, unreachable = [], set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or id(node) in unreachable:
            continue
        names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
        if names - {"self", "None", "True", "False"}:
            # `<lengths> and self.use_logn_attn`: an operand reading only the module that is
            # false decides the branch (never taken for this config) whatever the rest reads
            found += [(test, False) for test in _false_operands(node.test, module)]
            continue
        outcome = _evaluate(node.test, module)
        if outcome is None:
            continue  # a test that needs tensors: not a config switch
        found.append((ast.unparse(node.test), outcome))
        if outcome and len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
            unreachable.add(id(node.orelse[0]))
    return tuple(dict.fromkeys(found))


def _evaluate(test: ast.expr, module: nn.Module) -> bool | None:
    try:
        return bool(eval(compile(ast.Expression(test), "<test>", "eval"), {}, {"self": module}))
    except Exception:  # noqa: BLE001 - it needs more than the module
        return None


def _false_operands(test: ast.expr, module: nn.Module) -> list[str]:
    """The operands of an ``and`` test that read only the module and are false on it."""
    if not (isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And)):
        return []
    out = []
    for operand in test.values:
        names = {n.id for n in ast.walk(operand) if isinstance(n, ast.Name)}
        if not names - {"self", "None", "True", "False"} and _evaluate(operand, module) is False:
            out.append(ast.unparse(operand))
    return out


def init_assignments(cls: type) -> dict[str, ast.expr]:
    """``self.<attr> = <value>`` statements of ``cls.__init__``: {attr: value} (last wins)."""
    init = method_tree(cls, "__init__")
    if init is None:
        return {}
    return {
        target.attr: node.value
        for node in ast.walk(init)
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(target := node.targets[0], ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    }


def config_switches(module: nn.Module, part: Part = "both") -> tuple[tuple[str, bool], ...]:
    """``config_branches`` of ``module``'s ``part``: its forward and ``__init__``, one of the
    two, or the methods its forward calls (``helpers``: Falcon's ``_split_heads``), that read
    only the config, or the config and the constructor's parameters, each in the form its
    ``__init__`` can evaluate: ``self.config.x`` -> ``config.x``, ``self.attr`` -> the config
    expression ``__init__`` assigns it. Tests on anything else (``self.training``, a computed
    attribute) are left out: they are not config switches."""
    once = assigned_once(type(module))
    found: tuple = ()
    if part == "helpers":
        found = tuple(b for name in forward_helpers(module) for b in config_branches(module, name))
    if part in ("both", "forward"):
        found += config_branches(module)
    if part in ("both", "init"):  # __init__'s, on attributes it assigns once
        found += tuple(
            (test, outcome)
            for test, outcome in config_branches(module, "__init__")
            if _self_attrs(test) <= once
        )
    form = config_form(type(module))
    return tuple(
        dict.fromkeys((text, outcome) for test, outcome in found if (text := form(test)) is not None)
    )


def config_form(cls: type):
    """A function taking a test of ``cls``'s methods (source) to the form its ``__init__``
    evaluates, or None where it reads more than the config and the constructor's parameters."""
    assigned = {"config": "config"}
    params = _init_parameters(cls)
    for attr, value in init_assignments(cls).items():
        names = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
        # the config alone, or the config and the constructor's parameters (LFM2's
        # `config.layer_types[layer_idx] == "full_attention"`: a switch per layer)
        if ("config" in names and names <= {"config", "getattr"} | params) or (
            isinstance(value, ast.Name) and value.id in params  # a constructor flag
        ):
            assigned[attr] = ast.unparse(value)
    init = method_tree(cls, "__init__")
    parts = optional_parts(init.body[0]) if init and isinstance(init.body[0], ast.FunctionDef) else {}

    def form(test: str) -> str | None:
        # `self.mamba is not None`: the config test under which __init__ builds it
        tree = Substitute(assigned).visit(AsConfigTest(parts).visit(ast.parse(test, mode="eval")))
        return (
            None if "self" in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} else ast.unparse(tree)
        )

    return form


def forward_helpers(module: nn.Module) -> tuple[str, ...]:
    """The methods of ``module``'s class (not of ``nn.Module``) its forward calls as
    ``self.<name>(...)`` where the traced config reaches the call, and those they call, in
    the order first called."""
    cls, found, todo = type(module), [], ["forward"]
    while todo:
        tree = method_tree(cls, todo.pop(0))
        body = tree.body[0].body if tree is not None and isinstance(tree.body[0], ast.FunctionDef) else []
        for node in _reached(body, module):
            func = node.func if isinstance(node, ast.Call) else None
            name = func.attr if isinstance(func, ast.Attribute) and _is_self(func.value) else None
            if name and name not in found and name != "forward" and _own_method(cls, name):
                found.append(name)
                todo.append(name)
    return tuple(found)


def _reached(statements: list[ast.stmt], module: nn.Module):
    """The nodes of ``statements``, less the branches of config switches the module does not take."""
    for statement in statements:
        outcome = None
        if isinstance(statement, ast.If):
            names = {n.id for n in ast.walk(statement.test) if isinstance(n, ast.Name)}
            if names - {"self", "None", "True", "False"}:  # `x and self.flag`: decided by a false flag
                outcome = False if _false_operands(statement.test, module) else None
            else:
                outcome = _evaluate(statement.test, module)
        if outcome is None:
            yield from ast.walk(statement)
            continue
        yield from ast.walk(statement.test)
        yield from _reached(statement.body if outcome else statement.orelse, module)


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _own_method(cls: type, name: str) -> bool:
    return callable(getattr(cls, name, None)) and not hasattr(nn.Module, name)


def _init_parameters(cls: type) -> set[str]:
    try:
        return set(inspect.signature(cls.__init__).parameters) - {"self", "config"}
    except (TypeError, ValueError):
        return set()


def assigned_once(cls: type) -> set[str]:
    """The attributes ``cls.__init__`` assigns in exactly one statement."""
    init = method_tree(cls, "__init__")
    if init is None:
        return set()
    return {attr for attr, n in self_assignments(init).items() if n == 1}


def _self_attrs(test: str) -> set[str]:
    return {
        n.attr
        for n in ast.walk(ast.parse(test, mode="eval"))
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    }


class Substitute(ast.NodeTransformer):
    """``self.<attr>`` -> the parsed expression ``__init__`` assigns it."""

    def __init__(self, assigned: dict[str, str]) -> None:
        self.assigned = assigned

    def visit_Attribute(self, node: ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in self.assigned:
            return ast.parse(f"({self.assigned[node.attr]})", mode="eval").body
        return self.generic_visit(node)


def helper_branches(module: nn.Module) -> tuple[tuple[str, bool], ...]:
    """``config_branches`` of the methods ``__init__`` calls as ``self.<method>()``
    (DeepSeek's Hub ``_init_rope``: ``if self.config.rope_scaling is None:``)."""
    init = method_tree(type(module), "__init__")
    if init is None:
        return ()
    helpers = [
        node.value.func.attr
        for node in ast.walk(init)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and not node.value.args
        and isinstance(node.value.func, ast.Attribute)
        and isinstance(node.value.func.value, ast.Name)
        and node.value.func.value.id == "self"
    ]
    return tuple(b for name in dict.fromkeys(helpers) for b in config_branches(module, name))


# what a switch in ``__init__`` may read besides its ``config`` parameter
_INIT_NAMES = {"config", "hasattr", "getattr", "None", "True", "False"}


def _optional_part(node: ast.AST) -> bool:
    """``Part(...) if <test> else None`` (Granite-4.0-H's rotary embedding, built only when
    ``config.position_embedding_type == "rope"``): a switch like an ``if``."""
    return isinstance(node, ast.IfExp) and any(
        isinstance(side, ast.Constant) and side.value is None for side in (node.body, node.orelse)
    )


def init_switches(module: nn.Module, config, written=None) -> tuple[tuple[str, bool], ...]:
    """(test source, value on ``config``) for each ``if`` of the module's ``__init__`` whose
    test reads only its ``config`` parameter and constants (DeepSeek's Hub MoE:
    ``if hasattr(config, "ep_size") and config.ep_size > 1:`` builds the experts either way);
    ``written``: each test rewritten first (analyze/flat_layout.py: ``self.<attr>`` as the
    config expression ``__init__`` assigns it)."""
    tree = method_tree(type(module), "__init__")
    if tree is None:
        return ()
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.If) or _optional_part(node)):
            continue
        test = written(node.test) if written else node.test
        names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
        if "config" not in names or names - _INIT_NAMES:
            continue
        code = compile(ast.Expression(test), "<switch>", "eval")
        scope = {"__builtins__": {}, "hasattr": hasattr, "getattr": getattr}
        try:
            found.append((ast.unparse(test), bool(eval(code, scope, {"config": config}))))
        except (AttributeError, TypeError, ValueError, KeyError):
            continue  # a test the config cannot answer: not decided here
    return tuple(found)


def causal_switch(module: nn.Module) -> tuple[tuple[str, bool], ...]:
    """transformers' attention interface reads ``module.is_causal``: when ``__init__`` sets it
    from the config (gemma's ``not config.use_bidirectional_attention``), that expression is a
    config switch whose traced value is the module's."""
    init = method_tree(type(module), "__init__")
    if init is None:
        return ()
    for node in ast.walk(init):
        if (
            isinstance(node, ast.Assign)
            and ast.unparse(node.targets[0]) == "self.is_causal"
            and not isinstance(node.value, ast.Constant)
        ):
            tree = Substitute({"config": "config"}).visit(node.value)
            if "self" not in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}:
                return ((ast.unparse(tree), bool(getattr(module, "is_causal", True))),)
    return ()


def forward_switches(
    model: nn.Module, base: nn.Module, layer: nn.Module, *plans, part: Part = "both"
) -> tuple:
    """(class, config test, traced value) of the config switches (``config_switches`` of
    ``part``) of the causal LM, the base model, the decoder layer and the attention / MLP /
    MoE classes (the first instance of each), and, for "both", of the attention's
    ``is_causal``."""
    names = {getattr(p, "module_class", None) for p in plans} - {None}
    modules = [model, base, layer]
    # each class's instance in ``layer`` where it has one: a per-layer switch (Cohere2's
    # sliding window) is read on every traced layer's own instance
    for n in sorted(names):
        own = _instance(layer, n)
        modules.append(own if own is not None else _instance(model, n))
    out = []
    for module in dict.fromkeys(modules):
        cls = type(module).__name__
        found = config_switches(module, part) + (causal_switch(module) if part == "both" else ())
        out += [(cls, test, value) for test, value in found]
    return tuple(dict.fromkeys(out))


def _instance(root: nn.Module, class_name: str) -> nn.Module | None:
    """The first module of ``root`` of that class, in a list so that no module's own truth
    value (an empty ModuleList's) is asked."""
    found = [m for m in root.modules() if type(m).__name__ == class_name][:1]
    return found[0] if found else None


def asks_own_attribute(node: ast.AST) -> bool:
    """``hasattr(self, ...)`` or ``getattr(self, ...)``: a test fixed only once ``__init__``
    has built the module's parts (Llama-4's ``hasattr(self, "qk_norm")``)."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("hasattr", "getattr")
        and bool(node.args)
        and isinstance(node.args[0], ast.Name)
        and node.args[0].id == "self"
    )


def forward_switches_of_layers(model: nn.Module, base: nn.Module, layers, *plans) -> tuple:
    """``forward_switches`` with the first layer of each class (layers of two classes: Jamba's),
    less the tests whose value differs between the traced ``layers`` (Llama-4's ``layer_idx
    in config.moe_layers``): each layer took its own branch there, and the analysis proved
    every layer."""
    per_layer = [forward_switches(model, base, layer, *plans) for layer in layers]
    values: dict[tuple[str, str], set[bool]] = {}
    for switches in per_layer:
        for cls, test, value in switches:
            values.setdefault((cls, test), set()).add(value)
    firsts = {id(layer) for layer in one_per_class(layers)}
    return tuple(
        dict.fromkeys(
            s
            for layer, switches in zip(layers, per_layer)
            if id(layer) in firsts
            for s in switches
            if len(values[s[:2]]) == 1
        )
    )


def with_config_attrs(test: ast.expr, assigned: dict[str, ast.expr]) -> ast.expr:
    """``test`` with each ``self.<attr>`` replaced by what ``__init__`` assigns it, where
    that reads the config alone."""

    class _Swap(ast.NodeTransformer):
        def visit_Attribute(self, node: ast.Attribute):
            value = assigned.get(node.attr)
            if isinstance(node.value, ast.Name) and node.value.id == "self" and value is not None:
                names = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
                if names <= {"config"}:
                    return value
            return self.generic_visit(node)

    return _Swap().visit(ast.parse(ast.unparse(test), mode="eval")).body
