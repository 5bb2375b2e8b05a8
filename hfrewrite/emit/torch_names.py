"""Custom code spelling ``torch.nn.Linear`` where transformers writes ``nn.Linear``, or
building its own ``nn.Linear`` subclass that the analysis proved computes ``nn.Linear``'s
function with its constructor: one spelling for the passes, which match constructors by name
(``from torch import nn`` added where the file lacks it)."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

_TORCH_NN = m.Attribute(value=m.Name("torch"), attr=m.Name("nn"))
_IMPORT_NN = m.SimpleStatementLine(
    body=[m.ImportFrom(module=m.Name("torch"), names=[m.ImportAlias(name=m.Name("nn"), asname=None)])]
)


class _AsNn(cst.CSTTransformer):
    def __init__(self, constructors_only: bool = False) -> None:
        self.count, self.constructors_only = 0, constructors_only

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.BaseExpression:
        if self.constructors_only:  # transformers' own files: only what the passes match
            if m.matches(updated, m.Attribute(value=_TORCH_NN, attr=m.Name("Linear") | m.Name("ModuleList"))):
                self.count += 1
                return updated.with_changes(value=cst.Name("nn"))
            return updated
        if m.matches(updated, _TORCH_NN):
            self.count += 1
            return cst.Name("nn")
        return updated

    def leave_ImportFrom(self, original, updated):  # `from torch.nn import functional`: as written
        return original

    def leave_Import(self, original, updated):  # `import torch.nn.functional as F`: as written
        return original


class _ProvenLinears(cst.CSTTransformer):
    def __init__(self, classes: set[str]) -> None:
        self.classes, self.count = classes, 0

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if m.matches(updated.func, m.Name()) and updated.func.value in self.classes:
            self.count += 1
            return updated.with_changes(func=cst.Attribute(cst.Name("nn"), cst.Name("Linear")))
        return updated


class _TransposedLinears(cst.CSTTransformer):
    """``Cls(out, in)`` -> ``nn.Linear(in, out)`` for the proven transposed classes."""

    def __init__(self, classes: set[str]) -> None:
        self.classes, self.count = classes, 0

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if (
            m.matches(updated.func, m.Name())
            and updated.func.value in self.classes
            and len(updated.args) == 2
            and not any(a.keyword or a.star for a in updated.args)
        ):
            self.count += 1
            out, into = updated.args
            return updated.with_changes(
                func=cst.Attribute(cst.Name("nn"), cst.Name("Linear")),
                args=[into.with_changes(comma=out.comma), out.with_changes(comma=into.comma)],
            )
        return updated


def torch_nn_as_nn(
    module: cst.Module,
    linear_classes: tuple[str, ...] = (),
    transposed: tuple[str, ...] = (),
    constructors_only: bool = False,
) -> cst.Module:
    """``module`` with ``torch.nn.<x>`` written ``nn.<x>``, each class of ``linear_classes``
    (``ModelPlan.linear_classes``) the module defines built as ``nn.Linear``, and each of the
    ``transposed`` classes (``ModelPlan.transposed_linear_classes``: ``Conv1D(out, in)``)
    built as ``nn.Linear(in, out)``; ``constructors_only``: of ``torch.nn``, only
    ``torch.nn.Linear`` (cwm's) is respelled."""
    visitor = _AsNn(constructors_only)
    new = module.visit(visitor)
    defined = {n.name.value for n in new.body if isinstance(n, cst.ClassDef)}
    linears = _ProvenLinears(set(linear_classes) & defined)
    new = new.visit(linears)
    swapped = _TransposedLinears(set(transposed))
    new = new.visit(swapped)
    if not (visitor.count or linears.count or swapped.count) or any(
        m.matches(n, _IMPORT_NN) for n in new.body
    ):
        return new
    body = list(new.body)
    at = max(
        (
            i + 1
            for i, n in enumerate(body)
            if m.matches(n, m.SimpleStatementLine(body=[m.Import() | m.ImportFrom()]))
        ),
        default=0,
    )
    return new.with_changes(body=[*body[:at], cst.parse_statement("from torch import nn\n"), *body[at:]])


def builds_a_class(call: str) -> bool:
    """A call of a capitalised name: a layer (``nn.Linear``, vLLM's ``QKVParallelLinear``), or
    some other class, but not an exception."""
    last = call.rsplit(".", 1)[-1]
    return last[:1].isupper() and not last.endswith(("Error", "Exception", "Warning"))
