"""Run one pass on a source snippet, the way the pipeline does (no imports added here)."""

from textwrap import dedent

import libcst as cst

from hfrewrite.emit.pass_api import PassContext, PassResult
from hfrewrite.errors import HfrewriteError


def apply(pass_module, source: str, plan) -> PassResult:
    return pass_module.run(cst.parse_module(dedent(source)), PassContext(plan, "modeling_test.py"))


def rewrite(pass_module, source: str, plan) -> str:
    return apply(pass_module, source, plan).module.code


def assert_rewrites(pass_module, before: str, after: str, plan) -> None:
    """The pass turns the whole of ``before`` into ``after``, and never rewrites its own
    output: run again on ``after`` it leaves it as it is, or refuses it (one HfrewriteError),
    since the pattern it matched is gone."""
    assert rewrite(pass_module, before, plan) == after
    try:
        again = rewrite(pass_module, after, plan)
    except HfrewriteError:
        return
    assert again == dedent(after), f"{pass_module.__name__} rewrote its own output again"
