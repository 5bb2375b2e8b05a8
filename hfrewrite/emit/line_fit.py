"""Fit a formatted module to vLLM's line length: what the formatter leaves long.

ruff's formatter wraps code but never comments, docstrings or string literals, and the
source's (transformers: 119 columns) are often longer than vLLM's 88. :func:`fit_lines`
breaks them at spaces, the way a person would, and changes no value the module computes:

- a comment on its own line becomes several (a comment after code moves above it first);
- a line of a triple-quoted docstring continues on the next line at the same indentation;
- a one-line string literal becomes an implicit concatenation of parts, in parentheses
  where no bracket holds it already, which the formatter then lays out one part per line
  (an f-string is cut only outside its ``{...}``; a part with no placeholder loses its
  ``f``).

Pragmas (``# noqa``, ``# type:``), words longer than the line and strings with escapes at a
cut are left as they are. The result goes through the formatter again.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize

WIDTH = 88
_MARGIN = 12  # columns a string part leaves for its prefix, quotes, brackets and a comma
_PRAGMA = re.compile(r"#\s*(noqa|type:|fmt:|pragma|pylint|ruff:)")
_STRING = re.compile(r"(?P<prefix>[rRbBfFuU]*)(?P<quote>'|\")(?P<body>.*)(?P=quote)$", re.DOTALL)


def fit_lines(text: str, width: int = WIDTH) -> str:
    """``text`` with its long comments, docstring lines and string literals broken."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
        docstrings = _docstring_rows(ast.parse(text))
    except (SyntaxError, tokenize.TokenError):
        return text  # the parse check reports it
    lines = text.splitlines(keepends=True)
    edits: dict[int, list[str]] = {}  # 0-based row -> the lines replacing it
    strings: dict[int, list[tuple[tokenize.TokenInfo, bool, str]]] = {}
    depth, previous = 0, ""  # brackets open: inside them the parts need no parentheses
    own_comments = {}  # row -> comment token, for comments on their own line
    for tok in _whole_strings(tokens, lines):
        if tok.type == tokenize.COMMENT and not lines[tok.start[0] - 1][: tok.start[1]].strip():
            own_comments[tok.start[0] - 1] = tok
        after, previous = previous, tok.string if tok.type == tokenize.OP else ""
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        row = tok.start[0] - 1
        line = lines[row] if row < len(lines) else ""
        if len(line.rstrip("\r\n")) <= width and tok.type != tokenize.STRING:
            continue
        if tok.type == tokenize.COMMENT and row not in own_comments and not _PRAGMA.match(tok.string):
            edits[row] = _comment_lines(line, tok, width)
        elif tok.type == tokenize.STRING and tok.start[0] in docstrings:
            edits |= _reflowed_docstring(lines, range(tok.start[0] - 1, tok.end[0]), width)
        elif tok.type == tokenize.STRING and tok.start[0] == tok.end[0] and len(line.rstrip()) > width:
            strings.setdefault(row, []).append((tok, depth > 0, after))
    edits |= _reflowed_comments(lines, own_comments, width)
    for row, toks in strings.items():
        if row in edits:
            continue
        line = lines[row]
        for tok, bracketed, after in sorted(toks, key=lambda t: -t[0].start[1]):  # right to left
            parts = _string_parts(tok.string, width - _indent(line) - _MARGIN)
            if not parts and after == ":":  # one long word as a dict value: in parentheses,
                parts, bracketed = [tok.string], False  # the formatter puts it on its own line
            if parts:
                joined = " ".join(parts) if bracketed else "(" + " ".join(parts) + ")"
                line = line[: tok.start[1]] + joined + line[tok.end[1] :]
        edits[row] = [line]
    for row in sorted(edits, reverse=True):
        lines[row : row + 1] = edits[row]
    return "".join(lines)


def _reflowed_comments(lines: list[str], comments: dict, width: int) -> dict[int, list[str]]:
    """Own-line comments cut to ``width``; the words a cut leaves over open the next line
    when it continues the same paragraph (same indentation, a plain sentence)."""
    edits, carry = {}, ""
    for row in sorted(comments):
        line = lines[row]
        if _PRAGMA.match(comments[row].string):
            continue
        ending = line[len(line.rstrip("\r\n")) :] or "\n"
        lead = _comment_lead(line)
        if carry:
            line = lead + carry + " " + line[len(lead) :].lstrip()
            carry = ""
        elif len(line.rstrip("\r\n")) <= width:
            continue
        out = wrapped_text_line(line, width, comment_marker=True)
        nxt = row + 1
        text = lines[nxt][len(lead) :] if nxt in comments and _comment_lead(lines[nxt]) == lead else ""
        if len(out) > 1 and text[:1].isalpha() and not _PRAGMA.match(comments[nxt].string):
            carry = out.pop().rstrip("\r\n")[len(lead) :]
        edits[row] = [o if o.endswith(("\n", "\r")) else o + ending for o in out]
    return edits


def _reflowed_docstring(lines: list[str], rows: range, width: int) -> dict[int, list[str]]:
    """A docstring's long lines cut to ``width``; the words left over open the next line
    when it continues the sentence (same indentation, a plain word first)."""
    edits, carry = {}, ""
    for row in rows:
        line = lines[row]
        if carry:
            line = line[: _indent(line)] + carry + " " + line.lstrip(" ")
            carry = ""
        elif len(line.rstrip("\r\n")) <= width:
            continue
        out = wrapped_text_line(line, width)
        following = lines[row + 1] if row + 1 in rows else ""
        if (
            len(out) > 1
            and _indent(following) == _indent(line)
            and following.strip()[:1].isalpha()
            and row + 1 != rows[-1]  # not onto the closing quotes' line
        ):
            carry = out.pop().strip()
        edits[row] = out
    return edits


def _comment_lead(line: str) -> str:
    """Indentation, ``#`` and the spaces after it."""
    match = re.match(r" *#+ *", line)
    return match.group(0) if match else ""


def _whole_strings(tokens: list[tokenize.TokenInfo], lines: list[str]) -> list[tokenize.TokenInfo]:
    """The tokens, each f-string one STRING token as on Python 3.11 (3.12 splits them into
    FSTRING_START ... FSTRING_END), so the output does not depend on the Python version."""
    start_type = getattr(tokenize, "FSTRING_START", None)
    out, depth, first = [], 0, None
    for tok in tokens:
        if start_type is not None and tok.type == start_type:
            depth, first = depth + 1, first or tok
            continue
        if depth and tok.type == getattr(tokenize, "FSTRING_END", None):
            depth -= 1
            if not depth:
                rows = lines[first.start[0] - 1 : tok.end[0]]
                text = "".join(rows)[first.start[1] : len("".join(rows[:-1])) + tok.end[1]]
                out.append(tokenize.TokenInfo(tokenize.STRING, text, first.start, tok.end, first.line))
                first = None
            continue
        if not depth:
            out.append(tok)
    return out


def _docstring_rows(tree: ast.AST) -> set[int]:
    """First rows of the module's, classes' and functions' docstrings."""
    rows = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                rows.add(first.value.lineno)
    return rows


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _comment_lines(line: str, tok: tokenize.TokenInfo, width: int) -> list[str]:
    """A comment's own lines; a comment after code goes above the code, at its indent."""
    ending = line[len(line.rstrip("\r\n")) :] or "\n"
    code = line[: tok.start[1]].rstrip()
    indent = " " * _indent(line)
    comment = indent + tok.string
    out = wrapped_text_line(comment + ending, width, comment_marker=True)
    if code.strip():
        out.append(code + ending)
    return out


def wrapped_text_line(line: str, width: int, comment_marker: bool = False) -> list[str]:
    """``line`` cut at spaces into lines of at most ``width`` columns (as near as its words
    allow); continuation lines keep its indentation (and ``# `` for a comment)."""
    ending = line[len(line.rstrip("\r\n")) :] or "\n"
    line = line.rstrip("\r\n")
    indent = " " * _indent(line)
    lead = indent
    if comment_marker:
        marker = re.match(r"#+ *", line[len(indent) :])
        lead = indent + (marker.group(0) if marker else "# ")
    out = []
    while len(line) > width:
        cut = line.rfind(" ", len(lead) + 1, width + 1)
        if cut <= len(lead) or not line[:cut].strip(" #"):
            break  # one word longer than the line
        out.append(line[:cut].rstrip() + ending)
        line = lead + line[cut:].lstrip()
    out.append(line + ending)
    return out


def _string_parts(literal: str, width: int) -> list[str] | None:
    """``literal`` as literals of at most about ``width`` columns whose implicit
    concatenation is the same value, or None where it cannot be cut safely."""
    match = _STRING.match(literal)
    if not match or "b" in match["prefix"].lower():
        return None
    prefix, quote, body = match["prefix"], match["quote"], match["body"]
    fstring, raw = "f" in prefix.lower(), "r" in prefix.lower()
    cuts, depth, i = [], 0, 0
    while i < len(body):
        ch = body[i]
        if ch == "\\" and not raw:
            i += 2
            continue
        if fstring and body.startswith(("{{", "}}"), i):
            i += 2
            continue
        if fstring and ch in "{}":
            depth += 1 if ch == "{" else -1
        elif ch == " " and depth == 0:
            cuts.append(i + 1)  # the space ends the part before
        i += 1
    pieces, start, last = [], 0, 0
    for cut in cuts:
        if cut - start > width and last > start:
            pieces.append(body[start:last])
            start = last
        last = cut
    # the last words overflow the line itself (its margin less the prefix, quotes and a comma)
    if len(body) - start > width + _MARGIN - len(prefix) - 3 and last > start:
        pieces.append(body[start:last])
        start = last
    pieces.append(body[start:])
    if len(pieces) < 2 or (raw and any(p.endswith("\\") for p in pieces)):
        return None
    return [_literal(prefix, quote, p, fstring) for p in pieces]


def _literal(prefix: str, quote: str, piece: str, fstring: bool) -> str:
    """One part; an f-string part with no placeholder becomes a plain string."""
    if fstring and not re.search(r"(?<!\{)\{(?!\{)", piece.replace("{{", "")):
        prefix = prefix.replace("f", "").replace("F", "")
        piece = piece.replace("{{", "{").replace("}}", "}")
    return f"{prefix}{quote}{piece}{quote}"
