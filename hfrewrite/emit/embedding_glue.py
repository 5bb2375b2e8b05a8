"""The source's steps between its token embeddings and the first decoder layer, read for
``passes/vllm_model_interface.py``: the statements that turn the looked-up embeddings into
the first layer's input (granite's multiplier, nanochat's norm), the expression around the
lookup itself (gemma's scale), and the learned position rows added to the tokens' rows."""

from __future__ import annotations

from typing import NamedTuple

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.errors import HfrewriteError

NAME = "vllm_model_interface"

# Names carried statements may read besides the stream: ``self`` and libraries.
GLUE_NAMES = {"self", "torch", "nn", "F", "math", "None", "True", "False"}


def embedding_glue(
    forward: cst.FunctionDef | None, layers: str, embed: str, cls: str
) -> list[cst.BaseStatement]:
    """The source's statements that turn the embeddings into the first layer's input
    (granite's ``inputs_embeds * self.embedding_multiplier``, nanochat's norm), with the
    stream renamed to ``hidden_states``: a backward slice from the layer loop's input
    over the top-level statements, stopping at the embedding lookup; an ``if`` assigning the
    stream (AFMoE's muP scale) is kept whole, its test with it. Statements that read
    anything but the stream, ``self`` and libraries refuse (masks, positions, caches)."""
    body = list(forward.body.body) if forward is not None else []
    loop = _layer_loop(body, layers)
    if loop is None:
        return []
    calls = m.findall(body[loop].body, m.Call())
    first = calls[0].args[0].value if calls and calls[0].args else None
    if not isinstance(first, cst.Name):
        return []
    stream, sliced = _backward_slice(body[:loop], first.value, embed)
    stranger = sorted(
        t.root_names(cst.Module(sliced))
        - GLUE_NAMES
        - stream
        - {n for s in sliced for n in assigned_names(s)}
    )
    if stranger:
        raise HfrewriteError(
            f"{cls}: {NAME}: the embeddings are changed with {', '.join(stranger)} before the first layer"
        )
    return [s.visit(_IntoHiddenStates(stream)) for s in sliced]


def _layer_loop(body: list[cst.BaseStatement], layers: str) -> int | None:
    """The index of the top-level ``for`` over ``self.<layers>`` in ``body``, if any."""
    return next(
        (
            i
            for i, s in enumerate(body)
            if isinstance(s, cst.For)
            and f"self.{layers}" in {t.dotted(n) for n in m.findall(s.iter, m.Attribute())}
        ),
        None,
    )


class _Slice(NamedTuple):
    stream: set[str]  # the names the embeddings flow through, up to the layer loop's input
    statements: list[cst.BaseStatement]  # the statements computing it, in source order


def _backward_slice(statements: list[cst.BaseStatement], first: str, embed: str) -> _Slice:
    """The statements before the layer loop that compute its input ``first``, walking back
    to the lookup by ``self.<embed>``."""
    stream, needed, sliced = {first}, {first}, []
    for s in reversed(statements):
        small = s.body[0] if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 else None
        target = (
            small.targets[0].target if isinstance(small, cst.Assign) and len(small.targets) == 1 else None
        )
        lookup = {t.dotted(c.func) for c in m.findall(s, m.Call())} & {f"self.{embed}"}
        if lookup and assigned_names(s) & needed:
            # `if inputs_embeds is None: inputs_embeds = self.embed_tokens(...)`: the lookup
            stream |= assigned_names(s) & needed
            break
        if isinstance(s, cst.If) and assigned_names(s) & needed:
            # a switch on the stream (AFMoE's `if self.config.mup_enabled: h = h * ...`): kept,
            # with its test; what it reads is judged with the rest of the slice
            sliced.insert(0, s)
            needed |= t.root_names(s) - GLUE_NAMES
            continue
        if not (isinstance(target, cst.Name) and target.value in needed):
            continue
        reads = t.root_names(small.value) - GLUE_NAMES
        if isinstance(small.value, cst.Name):  # `hidden_states = inputs_embeds`: the same stream
            stream.add(small.value.value)
        else:
            sliced.insert(0, s)
        needed = (needed - {target.value}) | reads
    return _Slice(stream, sliced)


class _IntoHiddenStates(cst.CSTTransformer):
    """Renames the stream's names to ``hidden_states``."""

    def __init__(self, stream: set[str]) -> None:
        super().__init__()
        self.stream = stream

    def leave_Name(self, original, updated):
        return updated.with_changes(value="hidden_states") if updated.value in self.stream else updated

    def leave_SimpleStatementLine(self, original, updated):  # a trailing comment leads instead
        comment = updated.trailing_whitespace.comment
        if comment is None:
            return updated
        return updated.with_changes(
            leading_lines=[*updated.leading_lines, cst.EmptyLine(comment=comment)],
            trailing_whitespace=cst.TrailingWhitespace(),
        )


def lookup_expression(forward: cst.FunctionDef | None, embed: str, cls: str) -> cst.BaseExpression | None:
    """The source's own expression around its embedding lookup, when it is more than the
    lookup (``self.embed_tokens(input_ids) * scale``), with the lookup reading
    ``input_ids``: the body of ``embed_input_ids``. None for a bare lookup."""

    def looks_up(node: cst.CSTNode) -> bool:
        return any(t.dotted(c.func) == f"self.{embed}" for c in m.findall(node, m.Call()))

    assigned = [a.value for a in m.findall(forward, m.Assign() | m.AnnAssign())] if forward else []
    values = [v for v in assigned if v is not None and looks_up(v)]
    if len(values) != 1 or (isinstance(values[0], cst.Call) and t.dotted(values[0].func) == f"self.{embed}"):
        return None  # a bare lookup (or none to read)

    class _Ids(cst.CSTTransformer):
        def leave_Call(self, original, updated):
            if t.dotted(updated.func) == f"self.{embed}":
                return updated.with_changes(args=[cst.Arg(cst.Name("input_ids"))])
            return updated

    stranger = sorted(t.root_names(values[0]) - GLUE_NAMES - {"input_ids"})
    if stranger:
        raise HfrewriteError(f"{cls}: {NAME}: the embedding lookup is computed with {', '.join(stranger)}")
    return values[0].visit(_Ids())


def position_rows(position) -> str:
    """The statement adding the learned position rows to the looked-up tokens."""
    shifted = f"positions + {position.offset}" if position.offset else "positions"
    if position.module_call:
        rows = f"self.{position.attr}(positions)"
    elif not position.attr:  # a buffer of the base model, built in float32 whatever the dtype
        rows = f"self.{position.table}[{shifted}].to(hidden_states.dtype)"
    else:  # the source's class computes the positions itself; its table is read directly
        rows = f"self.{position.attr}.{position.table}[{shifted}]"
    scaled = f"hidden_states = hidden_states * {position.token_scale}\n" if position.token_scale else ""
    return f"{scaled}hidden_states = hidden_states + {rows}\n"


def assigned_names(node: cst.CSTNode) -> set[str]:
    """The plain names ``node`` assigns anywhere inside it."""
    names: set[str] = set()

    class _Targets(cst.CSTVisitor):
        def visit_AssignTarget(self, target: cst.AssignTarget) -> None:
            if isinstance(target.target, cst.Name):
                names.add(target.target.value)

    node.visit(_Targets())
    return names
