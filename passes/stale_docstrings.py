"""Drop a docstring's ``Args:`` section that documents parameters its function lost.

Matches a function whose docstring (a plain string literal, its first statement) has an
``Args:`` section naming a parameter the function no longer has: the Hugging Face
decoder layer's ``attention_mask``, ``past_key_values`` and ``use_cache`` (cohere, granite),
gone since the rewrite gave the function vLLM's signature.

Emits the docstring without that section (up to the next section header such as
``Returns:``, or the end); a docstring left with no text is dropped.

Preconditions (otherwise the docstring stays): the section's entries start at one
indentation, each ``name (type): ...`` or ``name: ...``; the literal is not an f-string
or a byte string.
"""

from __future__ import annotations

import re

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pass_api import PassContext, PassResult

NAME = "stale_docstrings"

_ENTRY = re.compile(r"(\s*)\**(\w+)\s*(\(|:)")
_SECTION = re.compile(r"\s*(Returns?|Yields?|Raises|Examples?|Notes?|References?):\s*$")


def _documented(lines: list[str]) -> tuple[list[str], int] | None:
    """The names an ``Args:`` section's entries document, and where the section ends."""
    names, indent = [], None
    for i, line in enumerate(lines):
        if _SECTION.match(line):
            return names, i
        entry = _ENTRY.match(line)
        if line.strip() and indent is None and entry:
            indent = entry[1]
        if entry and entry[1] == indent:
            names.append(entry[2])
        elif line.strip() and (indent is None or len(line) - len(line.lstrip()) < len(indent)):
            return None  # not laid out as entries: leave it
    return names, len(lines)


def without_stale_args(text: str, params: set[str]) -> str | None:
    """``text`` (a docstring's literal body) without its ``Args:`` section when the section
    names a parameter not in ``params``; None when it has no such section."""
    lines = text.split("\n")
    at = next((i for i, line in enumerate(lines) if line.strip() == "Args:"), None)
    if at is None:
        return None
    found = _documented(lines[at + 1 :])
    if found is None or not found[0] or set(found[0]) <= params:
        return None
    kept = lines[:at] + lines[at + 1 + found[1] :]
    while len(kept) > 1 and not kept[-2].strip() and not kept[-1].strip():
        kept.pop(-2)  # no blank line left where the section was, before the closing quotes
    return "\n".join(kept)


class _Drop(cst.CSTTransformer):
    def __init__(self) -> None:
        self.dropped = 0

    def leave_FunctionDef(self, original, updated):
        body = list(updated.body.body)
        doc = body[0] if body else None
        if not m.matches(doc, m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString())])):
            return updated
        literal = doc.body[0].value
        prefix, quote = literal.prefix.lower(), literal.quote
        if "f" in prefix or "b" in prefix:
            return updated
        params = updated.params
        names = {p.name.value for p in (*params.params, *params.kwonly_params, *params.posonly_params)}
        names |= {p.name.value for p in (params.star_arg, params.star_kwarg) if isinstance(p, cst.Param)}
        inner = literal.value[len(literal.prefix) + len(quote) : -len(quote)]
        text = without_stale_args(inner, names)
        if text is None:
            return updated
        self.dropped += 1
        if not text.strip():
            rest = body[1:] or [t.stmt("pass\n")]
            return updated.with_changes(body=updated.body.with_changes(body=rest))
        new = literal.with_changes(value=f"{literal.prefix}{quote}{text}{quote}")
        body[0] = doc.with_changes(body=[doc.body[0].with_changes(value=new)])
        return updated.with_changes(body=updated.body.with_changes(body=body))


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    dropper = _Drop()
    module = module.visit(dropper)
    return PassResult(module=module, matches=dropper.dropped)
