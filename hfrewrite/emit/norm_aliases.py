"""A norm class chosen in ``__init__`` by a config test (ChatGLM3's ``LayerNormFunc =
RMSNorm if config.rmsnorm else LayerNorm``): the traced modules are of the plan's norm class,
so the branch naming it is the one the traced config took. The alias is inlined as that
class, and a guard refuses configs whose test picks the other branch."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.errors import HfrewriteError

_ALIAS = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())], value=m.IfExp())])
_CONSTANTS = {"config", "True", "False", "None"}


def inline_norm_aliases(module: cst.Module, norm_class: str) -> cst.Module:
    """``module`` with each ``__init__``'s alias of ``norm_class`` chosen by a config test
    inlined, and the test guarded."""
    return module.visit(_Inline(norm_class))


class _Inline(cst.CSTTransformer):
    def __init__(self, norm_class: str) -> None:
        self.norm = norm_class

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        if updated.name.value != "__init__":
            return updated
        aliases: dict[str, str] = {}
        body = self._block(list(updated.body.body), aliases)
        if not aliases:
            return updated
        return t.with_body(updated, body).visit(_Rename(aliases))

    def _block(self, statements: list, aliases: dict[str, str]) -> list:
        """``statements`` (and those of the ``if`` blocks among them) with each alias
        replaced by its guard."""
        body = []
        for s in statements:
            if isinstance(s, cst.If) and s.orelse is None:
                s = s.with_changes(body=s.body.with_changes(body=self._block(list(s.body.body), aliases)))
            alias = self._alias(s)
            if alias is None:
                body.append(s)
                continue
            name, test, taken = alias
            aliases[name] = self.norm
            guard = f"if {'not ' if taken else ''}({t.code(test)}):\n" + (
                f'    raise NotImplementedError("hfrewrite: converted for configs where '
                f'`{t.code(test)}` is {taken}: another norm class is built here")\n'
            )
            body += t.stmts(guard)
        return body

    def _alias(self, s: cst.BaseStatement):
        """(alias, test, whether the test is true where the norm class is taken) of
        ``alias = A if test else B`` where one branch is the norm class, else None."""
        if not m.matches(s, _ALIAS):
            return None
        assign = s.body[0]
        choice = assign.value
        names = [t.dotted(choice.body), t.dotted(choice.orelse)]
        if names.count(self.norm) != 1:
            return None
        read = t.root_names(choice.test)
        if read - _CONSTANTS or "config" not in read:
            raise HfrewriteError(f"{self.norm}: its class is chosen by a test on more than the config")
        return assign.targets[0].target.value, choice.test, names[0] == self.norm


class _Rename(cst.CSTTransformer):
    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
        return (
            updated.with_changes(value=self.names[updated.value]) if updated.value in self.names else updated
        )
