"""Where an attention's forward returns parameters of its own beside its output
(GPT-NeoX-Japanese's ``dense_bias``, proven by the analysis: ``returned_parameters``), for
``passes/carry_decoder_layer.py``: the carried layer reads them off vLLM's attention."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.errors import HfrewriteError


def unpacked(assign: cst.Assign, returned: dict[int, str], attn: str, call: cst.Call) -> cst.Assign:
    """``assign`` (``first, *rest = self.<attn>(...)``) as ``first = <vLLM's call>``, or with
    the parameters the attention returns at the indices of ``returned`` read off it:
    ``first, bias = call, self.attention.dense_bias``."""
    first, *rest = (e.value for e in assign.targets[0].target.elements)
    kept = [(r, returned[i]) for i, r in enumerate(rest, 1) if i in returned]
    if not kept:
        return assign.with_changes(targets=[cst.AssignTarget(first)], value=call)
    names = ", ".join(t.code(n) for n in (first, *(r for r, _ in kept)))
    reads = ", ".join(f"{attn}.{attr}" for _, attr in kept)
    return t.stmt(f"{names} = {t.code(call)}, {reads}\n").body[0]


def returned_at(forward: cst.FunctionDef, attention, cls: str) -> dict[int, str]:
    """{index in the tuple the attention's forward returns: the parameter of its own there},
    for the parameters the analysis proved it returns (``returned_parameters``)."""
    wanted = getattr(attention, "returned_parameters", ())
    if not wanted:
        return {}
    at = {}
    for ret in _returns(forward):
        if isinstance(ret.value, cst.Tuple):
            for i, element in enumerate(ret.value.elements):
                if m.matches(element.value, m.Attribute(value=m.Name("self"), attr=m.Name())):
                    at.setdefault(element.value.attr.value, set()).add(i)
    found = {next(iter(at[a])): a for a in wanted if len(at.get(a, ())) == 1}
    if len(found) != len(wanted):
        raise HfrewriteError(
            f"{cls}: carry_decoder_layer: the parameters it returns are not at one place in its return"
        )
    return found


def _returns(forward: cst.FunctionDef) -> list[cst.Return]:
    """The forward's own return statements (not those of functions defined in it)."""
    found = []

    class _Find(cst.CSTVisitor):
        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return node is forward

        def visit_Return(self, node: cst.Return) -> None:
            found.append(node)

    forward.visit(_Find())
    return found


def read_off(returned: dict[int, str], attr: str) -> str:
    """The ``--explain`` note of the parameters the carried layer reads off its attention."""
    if not returned:
        return ""
    names = ", ".join(sorted(returned.values()))
    return f"; {names} read off self.{attr}, which returns it beside its output"
