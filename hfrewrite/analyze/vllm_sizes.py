"""What vLLM reads of a config to size a model, where the repository's configuration class
holds it under names of its own.

vLLM reads ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads`` and the kv-head
count (``n_head_kv``, then ``num_kv_heads``, ``num_key_value_heads``...) off the config, each
an int. OpenELM's Hub configuration holds ``model_dim``, ``num_transformer_layers`` and a list
of head counts per layer, the last under ``num_kv_heads``. For each such name the config does
not hold as the model's int, the config shim (emit/config_shim.py) gets a property computing it
from the source's own expressions: the embedding's width, the range the layer stack is built
over, and the largest of the layers' head counts. Each is checked on the traced config against
the built model.
"""

from __future__ import annotations

import ast

from torch import nn

from hfrewrite.analyze.branches import init_assignments

# the names vLLM reads the kv-head count under, in its order (the first present wins)
KV_NAMES = (
    "n_head_kv",
    "num_kv_heads",
    "num_key_value_heads",
    "multi_query_group_num",
    "num_attention_groups",
)


def vllm_sizes(
    config, small, base: nn.Module, layers_attr: str, embed: str, attention, counts
) -> tuple[tuple[str, str], ...]:
    """(name, expression of ``self``) for each size vLLM would misread on the repository's
    ``config`` (``small``: its traced copy, ``base`` built from it); ``counts``: each traced
    attention layer's (heads, kv heads)."""
    built = init_assignments(type(base))
    layers = _range_of(built.get(layers_attr))
    hidden = _argument(built.get(embed), 1, "embedding_dim")
    width = getattr(base.get_submodule(embed), "embedding_dim", None)
    wanted = {
        "num_hidden_layers": (layers, len(base.get_submodule(layers_attr))),
        "hidden_size": (hidden, width),
    }
    if layers is not None and attention is not None:
        heads, kv = (getattr(attention, f, None) for f in ("heads_expr", "kv_heads_expr"))
        wanted["num_attention_heads"] = (_largest(heads, layers), max(h for h, _ in counts))
        kv_name = next((n for n in KV_NAMES if getattr(config, n, None) is not None), "n_head_kv")
        wanted[kv_name if type(getattr(config, kv_name, None)) is int else "n_head_kv"] = (
            _largest(kv, layers),
            max(k for _, k in counts),
        )
    found = []
    for name, (expr, value) in wanted.items():
        if type(getattr(config, name, None)) is int and getattr(small, name, None) == value:
            continue  # vLLM reads it right
        if expr is None or _evaluated(expr, small) != value:
            continue  # no expression of the source gives it: vLLM's own default stands
        found.append((name, _on_self(expr)))
    return tuple(found)


def _largest(count: str | None, layers: str) -> str | None:
    """The largest of the layers' counts, where ``count`` reads the layer's index."""
    if count is None or "layer_idx" not in count:
        return count
    return f"max({count} for layer_idx in range({layers}))"


def _range_of(value: ast.expr | None) -> str | None:
    """``N`` of ``nn.ModuleList(... for i in range(N))`` (list or generator)."""
    for node in ast.walk(value) if value is not None else ():
        call = node.iter if isinstance(node, ast.comprehension) else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "range":
            return ast.unparse(call.args[0]) if len(call.args) == 1 else None
    return None


def _argument(value: ast.expr | None, at: int, keyword: str) -> str | None:
    if not isinstance(value, ast.Call):
        return None
    named = {k.arg: k.value for k in value.keywords}
    found = named.get(keyword) or (value.args[at] if len(value.args) > at else None)
    return ast.unparse(found) if found is not None else None


def _evaluated(expr: str, config):
    try:
        scope = {
            "__builtins__": {"max": max, "range": range},
            "config": config,
        }  # (a generator reads globals)
        return eval(compile(expr, "<size>", "eval"), scope)
    except Exception:  # noqa: BLE001 - a field this config lacks: no size
        return None


def _on_self(expr: str) -> str:
    """``config.x`` -> ``self.x``: the expression inside the configuration class."""
    tree = ast.parse(expr, mode="eval")
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "config":
            node.id = "self"
    return ast.unparse(tree)
