"""The numbers a Mamba-2 block's forward reads besides the weights vLLM's ``MambaMixer2``
loads: Falcon-H1's muP multipliers, its input times ``self.ssm_in_multiplier`` and its input
projection's output times ``self.mup_vector``, one number per column (vLLM's
``MambaMixer2.forward(hidden_states, mup_vector)`` takes the second; the file multiplies the
input by the first).

Each is found by what it does, not by its name: every float attribute and every buffer of the
block is changed in turn, and one whose change changes the block's output must be the input's
factor (a float, the block's output replayed with the input times it) or the projection's (a
buffer as wide as the projection, replayed with the projection's output times it); anything
else the forward reads refuses. A block built with those numbers at 1 (a default config) is
still proven: the changed values replay too.

The file builds the projection's factor as the source does: the one statement of the modeling
module registering that buffer (Falcon-H1's base model: ``layer.mamba.register_buffer(
"mup_vector", mup_vector.clone(), ...)``, ``mup_vector = compute_mup_vector(config)``), whose
expression of the config, evaluated on the traced config, gives the traced buffer.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hfrewrite.analyze.mixer_replay import block_output, random_input, replay_difference

_WITNESS = 1.375  # a float attribute's changed value: not 0, 1 or any default
_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Mamba2Scales:
    """The block's factors, where it has them."""

    input_attr: str = ""  # the attribute its input is multiplied by ("": none)
    input_expr: str = ""  # its config expression in the block's __init__
    projection_buffer: str = ""  # the buffer its projection's output is multiplied by
    projection_expr: str = ""  # the modeling module's expression of the config building it


def read_scales(
    module: nn.Module,
    config,
    width: int,
    tokens: int,
    expressions: dict[str, str],
) -> Mamba2Scales | str:
    """The block's factors: the float attributes and buffers whose change changes its output,
    one of each at most, with their config expressions (``expressions``: attribute -> its
    config expression in ``__init__``); a str: why the block reads something else. The
    replays proving them: ``changed_replays``."""
    floats = [name for name, value in vars(module).items() if type(value) is float]
    buffers = [name for name, _ in module.named_buffers(recurse=False)]
    read = [
        name
        for name in [*floats, *buffers]
        if output_changes(module, module, name, _changed(getattr(module, name)), width, tokens)
    ]
    inputs = [name for name in read if name in floats]
    projections = [
        name
        for name in read
        if name in buffers and getattr(module, name).numel() == module.in_proj.out_features
    ]
    others = [name for name in read if name not in inputs and name not in projections]
    if others or len(inputs) > 1 or len(projections) > 1:
        name = (others or inputs[1:] or projections[1:])[0]
        return f"its forward reads self.{name} otherwise than as the one factor of its input or of its projection"
    scales = Mamba2Scales()
    if inputs:
        if inputs[0] not in expressions:
            return f"no expression of its config in __init__ gives self.{inputs[0]}, its input's factor"
        scales = Mamba2Scales(inputs[0], expressions[inputs[0]])
    if projections:
        built, why = registered_expression(
            type(module), projections[0], config, getattr(module, projections[0])
        )
        if built is None:
            return why
        scales = Mamba2Scales(scales.input_attr, scales.input_expr, projections[0], built)
    return scales


def changed_replays(
    module: nn.Module,
    scales: Mamba2Scales,
    width: int,
    tokens: int,
    formula: Callable[[torch.Tensor, float, torch.Tensor | None], torch.Tensor],
) -> str | None:
    """Why the block does not replay with each of its factors changed (None: it does), so
    that a factor at 1 on the traced config is proven a factor too."""
    for name in filter(None, (scales.input_attr, scales.projection_buffer)):
        with _Setting(module, name, _changed(getattr(module, name))):
            difference = replay_difference(
                module,
                width,
                tokens,
                lambda h: formula(h, input_scale(module, scales), projection(module, scales)),
            )
        if difference is None or difference > _TOLERANCE:
            shown = "fails" if difference is None else f"differs by {difference:.2e}"
            return f"with self.{name} changed, replaying vLLM's Mamba-2 mixer with it as a factor {shown}"
    return None


def output_changes(block: nn.Module, owner: nn.Module, name: str, value, width: int, tokens: int) -> bool:
    """Setting ``owner.<name>`` (the block or a part of it) to ``value`` changes ``block``'s output."""
    base = _output(block, width, tokens)
    with _Setting(owner, name, value):
        out = _output(block, width, tokens)
    return base is None or out is None or not torch.equal(out, base)


def input_scale(module: nn.Module, scales: Mamba2Scales) -> float:
    """The number the block's input is multiplied by, as the block holds it now."""
    return getattr(module, scales.input_attr) if scales.input_attr else 1.0


def projection(module: nn.Module, scales: Mamba2Scales) -> torch.Tensor | None:
    """The factor of each column of the block's projection, as it holds it now (None: none)."""
    return getattr(module, scales.projection_buffer).reshape(-1) if scales.projection_buffer else None


def _output(module: nn.Module, width: int, tokens: int) -> torch.Tensor | None:
    return block_output(module, random_input(module, 1, tokens, width, seed=1))


def _changed(value):
    if type(value) is float:
        return value * _WITNESS + 0.125
    generator = torch.Generator().manual_seed(2)
    return torch.rand(value.shape, generator=generator, dtype=value.dtype) + 0.5


class _Setting:
    """``module.<name>`` set to ``value`` inside the ``with``."""

    def __init__(self, module: nn.Module, name: str, value) -> None:
        self.module, self.name, self.value = module, name, value

    def __enter__(self):
        self.kept = getattr(self.module, self.name)
        setattr(self.module, self.name, self.value)

    def __exit__(self, *exc) -> None:
        setattr(self.module, self.name, self.kept)


def registered_expression(cls: type, buffer: str, config, traced: torch.Tensor) -> tuple[str | None, str]:
    """(the config expression, "") the modeling module of ``cls`` registers ``buffer`` with:
    the one ``<x>.register_buffer("<buffer>", <value>)`` statement of its classes' ``__init__``,
    ``<value>`` through its function's locals an expression reading ``config``, up to a
    ``.clone()``, that gives ``traced`` on ``config``; else (None, why not)."""
    source_module = sys.modules.get(cls.__module__)
    found = set()
    for _, owner in inspect.getmembers(source_module, inspect.isclass):
        if owner.__module__ != cls.__module__ or "__init__" not in vars(owner):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(owner.__init__)))
        except (OSError, TypeError, SyntaxError):
            continue
        found |= _registrations(tree, buffer)
    if len(found) != 1:
        return None, f"self.{buffer}, its projection's factor, is not registered once from its config"
    expression = found.pop()
    try:
        value = eval(expression, vars(source_module), {"config": config})  # the source's own
    except Exception:  # noqa: BLE001 - an expression that does not evaluate on this config
        return None, f"{expression}, which builds self.{buffer}, does not evaluate on the traced config"
    if not (torch.is_tensor(value) and value.shape == traced.shape and torch.equal(value, traced)):
        return None, f"{expression} does not give the traced self.{buffer}"
    return expression, ""


def _registrations(tree: ast.AST, buffer: str) -> set[str]:
    """The expressions ``register_buffer("<buffer>", ...)`` is given in ``tree``, its locals
    assigned once substituted, a trailing ``.clone()`` dropped; only those reading ``config``
    and no attribute of ``self`` (any other name must be the module's: the evaluation fails
    otherwise)."""
    assigned: dict[str, ast.expr] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            assigned[name] = None if name in assigned else node.value
    found = set()
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "register_buffer"
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == buffer
        ):
            continue
        value = _unclone(node.args[1])
        if isinstance(value, ast.Name) and assigned.get(value.id) is not None:
            value = _unclone(assigned[value.id])
        names = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
        if "config" in names and not any(
            isinstance(n, ast.Attribute) and _is_self(n.value) for n in ast.walk(value)
        ):
            found.add(ast.unparse(value))
    return found


def _unclone(node: ast.expr) -> ast.expr:
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "clone"
        and not node.args
    ):
        return node.func.value
    return node


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"
