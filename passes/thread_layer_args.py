"""Thread ``cache_config``, ``quant_config`` and ``prefix`` through the layer classes.

Matches every class ``__init__`` that, after the earlier passes, reads one of those names
(vLLM layers need them: ``prefix`` names each weight, ``quant_config`` picks the kernels,
``cache_config`` configures the KV cache of ``Attention``), or builds such a class as
``self.x = Cls(...)``.

Emits keyword parameters ``cache_config: CacheConfig | None = None``,
``quant_config: QuantizationConfig | None = None``, ``prefix: str = ""`` on those classes, and
``cache_config=cache_config, ..., prefix=f"{prefix}.x"`` at each construction site (both
classes of ``self.x = A(...) if cond else B(...)``, hy_v3's dense or sparse MLP). The decoder
layer takes all three, as ``make_layers`` builds it with them (a Mamba-1 layer reads no
``quant_config``: prune_unused_params then drops it from both sides).

A part built through a local alias of its class chosen by literals (Bamba's
``ffn_layer_class = BambaMLP if num_experts == 1 else None``) is built by the class's name.

A class table the attention is chosen from (``CLASSES[config._attn_implementation](...)``,
in the layer or in the wrapper that builds the attention) becomes the traced class.

Preconditions: none beyond the earlier passes; classes whose ``__init__`` defines the names
itself (the vLLM model interface) are left alone.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.class_aliases import folded_class_aliases
from hfrewrite.emit.pass_api import PassContext, PassResult
from hfrewrite.emit.shared_matchers import self_attr

NAME = "thread_layer_args"
ARGS = {
    "cache_config": "cache_config: CacheConfig | None = None",
    "quant_config": "quant_config: QuantizationConfig | None = None",
    "prefix": 'prefix: str = ""',
}


def _assigned_names(fn: cst.FunctionDef) -> set[str]:
    names = {p.name.value for p in (*fn.params.params, *fn.params.kwonly_params)}
    for s in fn.body.body:
        if isinstance(s, cst.SimpleStatementLine) and isinstance(s.body[0], cst.Assign):
            for tgt in s.body[0].targets:
                if isinstance(tgt.target, cst.Name):
                    names.add(tgt.target.value)
    return names


def _constructors(value: cst.BaseExpression | None) -> list[cst.Call]:
    """The calls ``self.x = ...`` builds: one call, or each branch of a conditional."""
    if isinstance(value, cst.IfExp):
        return _constructors(value.body) + _constructors(value.orelse)
    return [value] if isinstance(value, cst.Call) else []


def _needs(module: cst.Module) -> dict[str, list[str]]:
    """Class -> which of ARGS its __init__ must accept (fixpoint over construction sites)."""
    inits = {
        n.name.value: t.find_method(n, "__init__")
        for n in module.body
        if isinstance(n, cst.ClassDef) and t.find_method(n, "__init__") is not None
    }
    own = {c: _assigned_names(fn) for c, fn in inits.items()}
    needs = {c: {a for a in ARGS if a in t.names_used(fn) and a not in own[c]} for c, fn in inits.items()}
    changed = True
    while changed:
        changed = False
        for c, fn in inits.items():
            # (statements under an `if` too: GPT-Neo's wrapper builds its attention in one)
            for s in (n for n in t.walk(fn.body) if isinstance(n, cst.SimpleStatementLine)):
                calls = _constructors(t.assigned_value(s)) if t.self_attr_assigned(s) else []
                for callee in map(t.call_name, calls):
                    extra = {a for a in needs.get(callee, ()) if a not in own[c]} - needs[c]
                    if extra:
                        needs[c] |= extra | {"prefix"}
                        changed = True
    return {c: [a for a in ARGS if a in n] for c, n in needs.items() if n}


class _Thread(cst.CSTTransformer):
    """Applied to one class's ``__init__`` (``cls``: that class), the only code it changes."""

    def __init__(self, needs: dict[str, list[str]], cls: str) -> None:
        self.needs = needs
        self.cls: list[str] = [cls]
        self.fn: list[str] = []

    def visit_ClassDef(self, node):
        self.cls.append(node.name.value)

    def leave_ClassDef(self, original, updated):
        self.cls.pop()
        return updated

    def visit_FunctionDef(self, node):
        self.fn.append(node.name.value)

    def leave_FunctionDef(self, original, updated):
        self.fn.pop()
        if updated.name.value != "__init__" or not self.cls or self.cls[-1] not in self.needs:
            return updated
        have = {p.name.value for p in updated.params.params}
        extra = [a for a in self.needs[self.cls[-1]] if a not in have]
        return t.with_params(updated, [ARGS[a] for a in extra])

    def leave_SimpleStatementLine(self, original, updated):
        attr = t.self_attr_assigned(updated)
        if not attr or self.fn[-1:] != ["__init__"]:
            return updated
        value = t.assigned_value(updated)
        threaded = self._threaded(value, attr)
        if threaded is value:
            return updated
        return updated.with_changes(body=[updated.body[0].with_changes(value=threaded)])

    def _threaded(self, value: cst.BaseExpression, attr: str) -> cst.BaseExpression:
        if isinstance(value, cst.IfExp):
            body, orelse = self._threaded(value.body, attr), self._threaded(value.orelse, attr)
            if body is value.body and orelse is value.orelse:
                return value
            return value.with_changes(body=body, orelse=orelse)
        if not isinstance(value, cst.Call):
            return value
        wanted = self.needs.get(t.call_name(value) or "", [])
        have = {a.keyword.value for a in value.args if a.keyword}
        extra = [a for a in wanted if a not in have]
        if not extra:
            return value
        values = {"prefix": f'f"{{prefix}}.{attr}"'}
        new_args = [cst.Arg(t.expr(values.get(a, a)), keyword=cst.Name(a)) for a in extra]
        args = list(value.args)
        if args:
            args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return value.with_changes(args=[*args, *new_args])


def _class_tables(module: cst.Module, attention: str) -> set[str]:
    """Module-level dicts whose values name classes, ``attention`` among them
    (``ATTENTION_CLASSES = {"eager": Attention, "flash_attention_2": FlashAttention}``)."""
    tables = set()
    for node in module.body:
        one = node.body[0] if isinstance(node, cst.SimpleStatementLine) and len(node.body) == 1 else None
        if isinstance(one, cst.Assign) and isinstance(one.value, cst.Dict) and len(one.targets) == 1:
            values = {t.code(e.value) for e in one.value.elements if isinstance(e, cst.DictElement)}
            if attention in values and isinstance(one.targets[0].target, cst.Name):
                tables.add(one.targets[0].target.value)
    return tables


class _ChosenAttention(cst.CSTTransformer):
    """``self.<attn> = TABLE[config._attn_implementation](...)`` -> ``Attention(...)``: the
    class the analysis traced (and the passes rewrote) in place of the table lookup."""

    def __init__(self, attr: str, cls: str, tables: set[str]) -> None:
        self.attr, self.cls, self.tables = attr, cls, tables

    def leave_Assign(self, original, updated):
        call = updated.value
        if (
            len(updated.targets) == 1
            and m.matches(updated.targets[0].target, self_attr(self.attr))
            and isinstance(call, cst.Call)
            and isinstance(call.func, cst.Subscript)
            and t.dotted(call.func.value) in self.tables
        ):
            return updated.with_changes(value=call.with_changes(func=cst.Name(self.cls)))
        return updated


def _without_class_aliases(node: cst.CSTNode, classes: set[str]) -> cst.CSTNode:
    """A class whose ``__init__`` builds a part through a local alias of its class (Bamba's
    ``ffn_layer_class``), building it by the class's name (``classes``: the file's own)."""
    init = t.find_method(node, "__init__") if isinstance(node, cst.ClassDef) else None
    folded = folded_class_aliases(init, classes) if init is not None else None
    return t.set_method(node, folded) if folded is not init else node


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    layer = ctx.plan.decoder_layer
    attention = ctx.plan.attention.module_class if ctx.plan.attention is not None else ""
    tables = _class_tables(module, attention) if attention else []
    # the class building the attention: the layer, or the wrapper around it (GPT-Neo's)
    owner = [layer.module_class, *layer.attention_wrappers][-1]
    attrs = layer.attention_block.split(".")
    if tables and len(attrs) == 1 + len(layer.attention_wrappers):
        chosen = _ChosenAttention(attrs[-1], attention, tables)
        module = t.replace_class(module, owner, t.find_class(module, owner).visit(chosen))
    classes = {node.name.value for node in module.body if isinstance(node, cst.ClassDef)}
    module = module.with_changes(body=[_without_class_aliases(node, classes) for node in module.body])
    needs = _needs(module)
    # make_layers passes all three to every layer class; prune_unused_params drops the unread
    for decoder in ctx.plan.decoder_layers:
        if decoder.module_class in needs:
            needs[decoder.module_class] = list(ARGS)
    imports = tuple(
        sym
        for a, sym in (
            ("cache_config", "CacheConfig"),
            ("quant_config", "QuantizationConfig"),
        )
        if any(a in n for n in needs.values())
    )
    body = []
    for node in module.body:  # only class __init__s change: the rest is not walked
        init = t.find_method(node, "__init__") if isinstance(node, cst.ClassDef) else None
        if init is not None:
            threaded = init.visit(_Thread(needs, node.name.value))
            if threaded is not init:
                node = t.set_method(node, threaded)
        body.append(node)
    return PassResult(module=module.with_changes(body=body), imports=imports, matches=len(needs))
