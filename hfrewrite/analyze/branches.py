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

from torch import nn


def config_branches(module: nn.Module, method: str = "forward") -> tuple[tuple[str, bool], ...]:
    """(test source, value on the traced module) for each config switch of ``method``; an
    ``elif`` after a branch taken is unreachable and left out."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(type(module), method))))
    except (OSError, TypeError, SyntaxError):
        return ()
    found, unreachable = [], set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or id(node) in unreachable:
            continue
        names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
        if names - {"self", "None", "True", "False"}:
            continue
        try:
            outcome = bool(
                eval(
                    compile(ast.Expression(node.test), "<test>", "eval"),
                    {},
                    {"self": module},
                )
            )
        except Exception:  # noqa: BLE001, S112 - a test that needs tensors: not a config switch
            continue
        found.append((ast.unparse(node.test), outcome))
        if outcome and len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
            unreachable.add(id(node.orelse[0]))
    return tuple(dict.fromkeys(found))
