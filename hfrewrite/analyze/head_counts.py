"""The config fields that hold the head counts, and the counts no single field holds, read
from the attention's own ``__init__``.

Falcon-7B keeps one kv head for its multi-query attention: ``self.num_kv_heads =
config.num_kv_heads if (self.new_decoder_architecture or not self.multi_query) else 1``.
No config field holds 1, but the source's expression, with the attributes it reads replaced
by the config expressions ``__init__`` assigns them, does for every config:
``config.num_kv_heads if (config.new_decoder_architecture or not config.multi_query) else 1``.
That expression is taken when the attribute's traced value is the proven count and the
expression, evaluated on the traced config, gives it too.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect

from torch import nn

from hfrewrite.analyze.branches import Substitute, assigned_once, init_assignments, method_tree
from hfrewrite.analyze.plan import AttentionPlan

_CONFIG_NAMES = {"config", "None", "True", "False"}
LOCAL = "local "  # the key prefix of an __init__ local among the attributes


def head_fields(small, attention: AttentionPlan) -> dict:
    """The config fields that hold the head and kv-head counts, checked by value in the
    traced config (transformers maps each model's own names onto these)."""
    fields = {}
    if getattr(small, "num_attention_heads", None) == attention.num_heads:
        fields["heads_field"] = "num_attention_heads"
        if getattr(small, "num_key_value_heads", None) == attention.num_kv_heads:
            fields["kv_heads_field"] = "num_key_value_heads"
        elif attention.num_kv_heads != 1 and getattr(small, "num_kv_heads", None) == attention.num_kv_heads:
            fields["kv_heads_field"] = "num_kv_heads"  # Falcon's own name (grouped: Falcon-40B)
        elif (
            attention.num_kv_heads == attention.num_heads
            and getattr(small, "num_key_value_heads", None) is None
        ):
            fields["kv_heads_field"] = "num_attention_heads"
    return fields


def head_expressions(
    attention: AttentionPlan, module: nn.Module, small, others: tuple[tuple[nn.Module, int, int], ...] = ()
) -> AttentionPlan:
    """Where no config field holds a head count, the source's own config expression that
    does; where ``__init__`` takes no config (XGLM's ``XGLMAttention(embed_dim, num_heads)``),
    its own expression of its parameters that does (the attribute it assigns from it holds
    the count). ``others``: the other attention layers' blocks and (head, kv-head) counts,
    which the expression must give too."""
    given = not _takes_config(type(module))
    heads = [(m, h) for m, h, _ in others]
    kv_heads = [(m, kv) for m, _, kv in others]
    # a count that differs between layers (MiMo-V2-Flash's kv heads, doubled on its sliding
    # layers) is no config field's, whatever the lead layer's value
    if any(h != attention.num_heads for _, h in heads):
        attention = dataclasses.replace(attention, heads_field=None)
    if any(kv != attention.num_kv_heads for _, kv in kv_heads):
        attention = dataclasses.replace(attention, kv_heads_field=None)
    return dataclasses.replace(
        attention,
        heads_expr=None
        if attention.heads_field and not given
        else count_expression(module, small, attention.num_heads, heads),
        kv_heads_expr=None
        if attention.kv_heads_field and not given
        else count_expression(module, small, attention.num_kv_heads, kv_heads),
    )


def count_expression(
    module: nn.Module, config, count: int, others: list[tuple[nn.Module, int]] = ()
) -> str | None:
    """The one config expression of ``module.__init__`` that holds ``count``, and each of
    ``others``' counts on its own block; else None. It may read the layer's own constructor
    parameters (OpenELM's ``config.num_query_heads[layer_idx]``), at the values the module
    keeps of them."""
    layer = layer_parameters(module)
    fitting = {
        attr: text
        for attr, text in _config_expressions(type(module), set(layer)).items()
        if _evaluates_to(text, config, count, layer)
        and all(evaluate_count(text, config, other) == n for other, n in others)
    }
    # an attribute holding the count, else a local the projections are sized by
    found = {
        text
        for attr, text in fitting.items()
        if type(getattr(module, attr, None)) is int and getattr(module, attr) == count
    }
    found = found or {text for attr, text in fitting.items() if attr.startswith(LOCAL)}
    return found.pop() if len(found) == 1 else None


def layer_parameters(module: nn.Module) -> dict[str, int]:
    """The constructor parameters whose int value ``module`` keeps as an attribute
    (``self.layer_idx = layer_idx``): {parameter: value}."""
    params = set(inspect.signature(type(module).__init__).parameters) - {"self", "config"}
    return {
        value.id: getattr(module, attr)
        for attr, value in init_assignments(type(module)).items()
        if isinstance(value, ast.Name) and value.id in params and type(getattr(module, attr, None)) is int
    }


def evaluate_count(text: str, config, module: nn.Module) -> object:
    """``text`` evaluated on ``config`` and ``module``'s constructor parameters; None where it fails."""
    try:
        scope = {"config": config, **layer_parameters(module)}
        return eval(compile(text, "<head count>", "eval"), {"__builtins__": {}}, scope)
    except Exception:  # noqa: BLE001 - a field this config lacks: not this expression
        return None


def _config_expressions(cls: type, layer: set[str] = frozenset()) -> dict[str, str]:
    """{attr: its value as an expression of the config alone (and of ``layer``, constructor
    parameters the module keeps)}, for the attributes ``__init__`` assigns once, its locals
    (``q_heads = ...``) replaced by what they are assigned; where ``__init__`` takes no
    config, of its parameters."""
    params = set(inspect.signature(cls.__init__).parameters) - {"self"}
    allowed = _CONFIG_NAMES | layer if _takes_config(cls) else params | _CONFIG_NAMES
    once = assigned_once(cls)
    values = {attr: ast.unparse(v) for attr, v in init_assignments(cls).items() if attr in once}
    local = _locals_assigned_once(cls)
    # a local the projections are sized by (``num_key_value_heads = ... if is_swa else ...``):
    # no attribute holds its value, so it is taken only where it gives every traced layer its count
    values |= {f"{LOCAL}{name}": value for name, value in local.items()}
    out = {}
    for attr, value in values.items():
        tree = ast.parse(value, mode="eval").body
        for _ in range(4):  # attributes read attributes: a few rounds reach the config
            tree = Substitute(values).visit(ast.parse(ast.unparse(tree), mode="eval")).body
            tree = _SubstituteNames(local, allowed).visit(ast.parse(ast.unparse(tree), mode="eval")).body
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        if names and names <= allowed and names - {"None", "True", "False"} and not _calls(tree):
            out[attr] = ast.unparse(tree)
    return out


def _locals_assigned_once(cls: type) -> dict[str, str]:
    """``name = <value>`` statements of ``cls.__init__``, for names assigned once."""
    init = method_tree(cls, "__init__")
    assigns = [
        (node.targets[0].id, node.value)
        for node in (ast.walk(init) if init is not None else ())
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
    ]
    names = [name for name, _ in assigns]
    return {name: ast.unparse(value) for name, value in assigns if names.count(name) == 1}


class _SubstituteNames(ast.NodeTransformer):
    """A local name -> the parsed expression ``__init__`` assigns it (``keep``: names left as they are)."""

    def __init__(self, assigned: dict[str, str], keep: set[str]) -> None:
        self.assigned, self.keep = assigned, keep

    def visit_Name(self, node: ast.Name):
        if node.id in self.assigned and node.id not in self.keep:
            return ast.parse(f"({self.assigned[node.id]})", mode="eval").body
        return node


def _takes_config(cls: type) -> bool:
    return "config" in inspect.signature(cls.__init__).parameters


def _calls(tree: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) for n in ast.walk(tree))


def _evaluates_to(text: str, config, count: int, layer: dict[str, int]) -> bool:
    """``text`` gives ``count`` on ``config`` (and the layer's kept parameters); an expression
    of ``__init__``'s own parameters (no config) is the attribute's assigned value, which
    holds it already."""
    if "config" not in {n.id for n in ast.walk(ast.parse(text, mode="eval")) if isinstance(n, ast.Name)}:
        return True
    try:
        value = eval(compile(text, "<head count>", "eval"), {"__builtins__": {}}, {"config": config, **layer})
    except Exception:  # noqa: BLE001 - a field this config lacks: not this expression
        return False
    return type(value) is int and value == count
