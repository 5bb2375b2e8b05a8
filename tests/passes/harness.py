"""Run one pass on a source snippet, the way the pipeline does (no imports added here)."""

from textwrap import dedent

import libcst as cst

from hfrewrite.emit.pass_api import PassContext, PassResult


def apply(pass_module, source: str, plan) -> PassResult:
    return pass_module.run(cst.parse_module(dedent(source)), PassContext(plan, "modeling_test.py"))


def rewrite(pass_module, source: str, plan) -> str:
    return apply(pass_module, source, plan).module.code
