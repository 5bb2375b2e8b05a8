"""Refusal cases as one base and a one-line change: ``mutate`` edits a method's own source
(a fixture's here, or an installed modeling file's), never a copy of it."""

from __future__ import annotations
import __future__

import inspect
import itertools
import linecache
import textwrap

import pytest

_EDITS = itertools.count()


def edited(fn, edits, owner=None):
    """``fn`` compiled again from its own source with each ``(old, new)`` of ``edits``
    applied, each ``old`` found exactly once, in ``fn``'s module globals; ``owner``: the
    class it is a method of, for a zero-argument ``super()``. The edited source is what
    ``inspect.getsource`` gives for the result (analysis reads config switches there)."""
    fn = inspect.unwrap(fn)
    source = inspect.getsource(fn)
    for old, new in edits:
        assert source.count(old) == 1, f"{old!r} is not in {fn.__qualname__} exactly once"
        source = source.replace(old, new)
    # defined inside a function of `__class__`, the cell a zero-argument super() reads
    wrapper = (
        "def _edited(__class__):\n"
        + textwrap.indent(textwrap.dedent(source), "    ")
        + f"    return {fn.__name__}\n"
    )
    filename = f"<{fn.__qualname__}, edit {next(_EDITS)}>"
    linecache.cache[filename] = (len(wrapper), None, wrapper.splitlines(True), filename)
    # annotations stay unevaluated, as the modeling files' own may name what they do not import
    flags = __future__.annotations.compiler_flag
    code = compile(wrapper, filename, "exec", flags=flags, dont_inherit=True)
    namespace: dict = {}
    exec(code, fn.__globals__, namespace)  # noqa: S102 - the test's own edit of known source
    return namespace["_edited"](owner)


@pytest.fixture
def mutate(monkeypatch):
    """``mutate(cls, "forward", (old, new), ...)``: for this test, ``cls.forward`` is its
    own source with those edits."""

    def apply(cls, method: str, *edits: tuple[str, str]) -> None:
        owner = next(c for c in cls.__mro__ if method in vars(c))  # where it is defined
        monkeypatch.setattr(cls, method, edited(getattr(cls, method), edits, owner))

    return apply
