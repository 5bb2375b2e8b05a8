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

from hfrewrite.analyze.branches import Substitute, assigned_once, init_assignments
from hfrewrite.analyze.plan import AttentionPlan

_CONFIG_NAMES = {"config", "None", "True", "False"}


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


def head_expressions(attention: AttentionPlan, module: nn.Module, small) -> AttentionPlan:
    """Where no config field holds a head count, the source's own config expression that
    does; where ``__init__`` takes no config (XGLM's ``XGLMAttention(embed_dim, num_heads)``),
    its own expression of its parameters that does (the attribute it assigns from it holds
    the count)."""
    given = not _takes_config(type(module))
    return dataclasses.replace(
        attention,
        heads_expr=None
        if attention.heads_field and not given
        else count_expression(module, small, attention.num_heads),
        kv_heads_expr=None
        if attention.kv_heads_field and not given
        else count_expression(module, small, attention.num_kv_heads),
    )


def count_expression(module: nn.Module, config, count: int) -> str | None:
    """The one config expression of ``module.__init__`` that holds ``count``; else None."""
    found = {
        text
        for attr, text in _config_expressions(type(module)).items()
        if type(getattr(module, attr, None)) is int
        and getattr(module, attr) == count
        and _evaluates_to(text, config, count)
    }
    return found.pop() if len(found) == 1 else None


def _config_expressions(cls: type) -> dict[str, str]:
    """{attr: its value as an expression of the config alone}, for the attributes
    ``__init__`` assigns once; where ``__init__`` takes no config, of its parameters."""
    params = set(inspect.signature(cls.__init__).parameters) - {"self"}
    allowed = _CONFIG_NAMES if _takes_config(cls) else params | _CONFIG_NAMES
    once = assigned_once(cls)
    values = {attr: ast.unparse(v) for attr, v in init_assignments(cls).items() if attr in once}
    out = {}
    for attr, value in values.items():
        tree = ast.parse(value, mode="eval").body
        for _ in range(4):  # attributes read attributes: a few rounds reach the config
            tree = Substitute(values).visit(ast.parse(ast.unparse(tree), mode="eval")).body
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        if names and names <= allowed and names - {"None", "True", "False"} and not _calls(tree):
            out[attr] = ast.unparse(tree)
    return out


def _takes_config(cls: type) -> bool:
    return "config" in inspect.signature(cls.__init__).parameters


def _calls(tree: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) for n in ast.walk(tree))


def _evaluates_to(text: str, config, count: int) -> bool:
    """``text`` gives ``count`` on ``config``; an expression of ``__init__``'s own parameters
    (no config) is the attribute's assigned value, which holds it already."""
    if "config" not in {n.id for n in ast.walk(ast.parse(text, mode="eval")) if isinstance(n, ast.Name)}:
        return True
    try:
        value = eval(compile(text, "<head count>", "eval"), {"__builtins__": {}}, {"config": config})
    except Exception:  # noqa: BLE001 - a field this config lacks: not this expression
        return False
    return type(value) is int and value == count
