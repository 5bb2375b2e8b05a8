"""Remove what vLLM does not use from the Hugging Face source.

Matches what is left of the Transformers runtime after the other passes:

* decorators and base classes imported from Transformers internals (relative imports such
  as ``@auto_docstring``, ``GradientCheckpointingLayer``) -> dropped / ``nn.Module``;
  ``super().__init__(config)`` -> ``super().__init__()``;
* relative imports: the model's configuration class becomes
  ``from transformers import LlamaConfig``; helpers the carried source still uses
  (``ACT2FN``) are imported from their absolute module; every other import goes;
* top-level definitions no longer reachable from the architecture class (rotary helpers,
  ``repeat_kv``, ``eager_attention_forward``, the HF norm and rotary classes, the
  ``PreTrainedModel`` and task-head classes, ``logger``, ``__all__``);
* private methods nothing calls any more (``_split_heads``, replaced with its use);
* ``self.x = ...`` assignments in ``__init__`` whose attribute nothing reads any more
  (``self.is_causal``, ``self.attention_dropout``, ``self.gradient_checkpointing``...).

Emits the same module minus those; kept classes keep their names, docstrings and comments.

Preconditions: none; removal is by reachability, so nothing the model uses can go.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from hfrewrite import cst_tools as t
from hfrewrite.pass_api import PassContext, PassResult

NAME = "strip_hf_runtime"
# Attributes vLLM itself reads from the model classes (those built from `vllm_config`),
# including its MixtureOfExperts protocol.
READ_BY_VLLM = {
    "config", "make_empty_intermediate_tensors", "moe_layers", "num_moe_layers",
    "num_expert_groups", "num_logical_experts", "num_physical_experts",
    "num_local_physical_experts", "num_routed_experts", "num_shared_experts",
    "num_redundant_experts",
}


def _defined_name(node: cst.CSTNode) -> str | None:
    if isinstance(node, (cst.ClassDef, cst.FunctionDef)):
        return node.name.value
    if isinstance(node, cst.SimpleStatementLine) and isinstance(node.body[0], (cst.Assign, cst.AnnAssign)):
        small = node.body[0]
        target = small.targets[0].target if isinstance(small, cst.Assign) else small.target
        return target.value if isinstance(target, cst.Name) else None
    return None


def _relative_imports(module: cst.Module) -> tuple[set[str], list[tuple[str, str]]]:
    """Names imported from Transformers internals, and (module, name) of configuration classes."""
    names, configs = set(), []
    for node in module.body:
        if isinstance(node, cst.SimpleStatementLine) and isinstance(node.body[0], cst.ImportFrom):
            imp = node.body[0]
            if imp.relative and not isinstance(imp.names, cst.ImportStar):
                source = t.dotted(imp.module) if imp.module else ""
                for alias in imp.names:
                    names.add(alias.evaluated_alias or alias.evaluated_name)
                    if source.startswith("configuration_"):
                        configs.append(alias.evaluated_name)
    return names, configs


class _DropHfRuntime(cst.CSTTransformer):
    def __init__(self, hf_names: set[str]) -> None:
        self.hf_names = hf_names

    def leave_ClassDef(self, original, updated):
        decorators = [d for d in updated.decorators if t.dotted(getattr(d.decorator, "func", d.decorator)) not in self.hf_names]
        bases = [b for b in updated.bases if t.dotted(b.value) not in self.hf_names]
        if len(bases) != len(updated.bases) and not any(t.code(b.value) == "nn.Module" for b in bases):
            bases = [cst.Arg(t.expr("nn.Module")), *bases]
        updated = updated.with_changes(decorators=decorators, bases=bases)
        if [t.code(b.value) for b in bases] == ["nn.Module"]:
            updated = updated.visit(_NoSuperArgs())  # nn.Module.__init__ takes no config
        return updated

    def leave_FunctionDef(self, original, updated):
        decorators = [d for d in updated.decorators if t.dotted(getattr(d.decorator, "func", d.decorator)) not in self.hf_names]
        return updated.with_changes(decorators=decorators)



class _NoSuperArgs(cst.CSTTransformer):
    def leave_Call(self, original, updated):
        if t.code(updated.func) == "super().__init__" and updated.args:
            return updated.with_changes(args=[])
        return updated


def _absolute(imp: cst.ImportFrom, modeling_file: str) -> str:
    """The absolute module of a relative import inside transformers/models/<dir>/."""
    package = ["transformers", "models", modeling_file.removeprefix("modeling_").removesuffix(".py")]
    level = len(imp.relative)
    parts = package[: len(package) - level + 1]
    return ".".join([*parts, t.dotted(imp.module)] if imp.module else parts)


def _reachable(module: cst.Module, root: str) -> set[str]:
    defs = {n: node for node in module.body if (n := _defined_name(node))}
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in defs:
            continue
        seen.add(name)
        todo.extend(t.names_used(defs[name]) - seen)
    return seen


def _stateless_classes(module: cst.Module) -> set[str]:
    """Module classes that hold no checkpoint state: no parameters, no persistent buffers,
    no layers (HF's rotary embedding). Dropping an unused one cannot orphan a weight."""
    classes = {n.name.value: n for n in module.body if isinstance(n, cst.ClassDef)}

    def holds_state(cls: cst.ClassDef) -> bool:
        calls = {t.dotted(c.func) or "" for c in m.findall(cls, m.Call())}
        persistent = m.findall(cls, m.Arg(keyword=m.Name("persistent"), value=m.Name("True")))
        layers = {c for c in calls if c.startswith("nn.") and c[3:4].isupper()} - {"nn.Buffer", "nn.Module"}
        return bool(persistent or layers or any(c.endswith("Parameter") for c in calls)
                    or calls & (set(classes) - {cls.name.value}))

    return {name for name, cls in classes.items() if not holds_state(cls)}


class _PruneAttributes(cst.CSTTransformer):
    """Drop `self.x = ...` from a class's __init__ when nothing reads `self.x` in that class
    and no other class reads it through a submodule (`self.model.x`). A value that builds
    something is dropped only when it is a stateless class of this module, so the set of
    checkpoint weights never changes."""

    def __init__(self, cross_reads: set[str], stateless: set[str]) -> None:
        self.cross_reads = cross_reads
        self.stateless = stateless
        self.read: list[set[str]] = []
        self.in_init = 0

    def visit_ClassDef(self, node):
        reader = _ReadAttributes()
        node.visit(reader)
        init = t.find_method(node, "__init__")
        model_class = init is not None and "vllm_config" in t.names_used(init.params)
        self.read.append(reader.self_reads | self.cross_reads | (READ_BY_VLLM if model_class else set()))

    def leave_ClassDef(self, original, updated):
        self.read.pop()
        return updated

    def visit_FunctionDef(self, node):
        self.in_init += node.name.value == "__init__"

    def leave_FunctionDef(self, original, updated):
        self.in_init -= original.name.value == "__init__"
        return updated

    def leave_SimpleStatementLine(self, original, updated):
        attr = t.self_attr_assigned(updated)
        if self.in_init and self.read and attr and attr not in self.read[-1]:
            value = t.assigned_value(updated)
            builds = [c for c in _calls(value) if c not in ("getattr", "max", "min", "int", "float")]
            if all(c in self.stateless for c in builds):
                return cst.RemoveFromParent()
        return updated


def _calls(node: cst.CSTNode) -> list[str]:
    found: list[str] = []

    class _Calls(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            found.append(t.dotted(call.func) or "?")

    node.visit(_Calls())
    return found


class _ReadAttributes(cst.CSTVisitor):
    """`self.x` reads, and `<other>.x` reads of other objects (a class reaching into a
    submodule, `self.model.embed_tokens`, or into a block, `block.n_logical_experts`);
    reads of config and library attributes do not count."""

    def __init__(self) -> None:
        self.self_reads: set[str] = set()
        self.cross_reads: set[str] = set()

    def visit_Assign(self, node):
        # the target `self.x` of an assignment is not a read; its value may be
        node.value.visit(self)
        for target in node.targets:
            if not (isinstance(target.target, cst.Attribute) and t.dotted(target.target.value) == "self"):
                target.visit(self)
        return False

    def visit_Attribute(self, node):
        base = t.dotted(node.value) or ""
        if base == "self":
            self.self_reads.add(node.attr.value)
        elif base and base.split(".")[0] not in ("config", "torch", "nn", "F") and not base.endswith("_config"):
            # another object's attribute: `self.model.embed_tokens`, `block.n_logical_experts`
            self.cross_reads.add(node.attr.value)


def _drop_unused_private_methods(module: cst.Module) -> cst.Module:
    """Private helpers (``_split_heads``) that no code refers to any more: the rewritten
    forward replaced their only use. Dunder methods are never dropped."""
    used: set[str] = set()

    class _Attrs(cst.CSTVisitor):
        def visit_Attribute(self, node: cst.Attribute) -> None:
            used.add(node.attr.value)

    module.visit(_Attrs())

    def unused(member: cst.CSTNode) -> bool:
        return (isinstance(member, cst.FunctionDef) and member.name.value.startswith("_")
                and not member.name.value.startswith("__") and member.name.value not in used)

    return module.with_changes(body=[
        node.with_changes(body=node.body.with_changes(body=[m for m in node.body.body if not unused(m)]))
        if isinstance(node, cst.ClassDef) else node
        for node in module.body
    ])


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    hf_names, configs = _relative_imports(module)
    module = module.visit(_DropHfRuntime(hf_names))
    module = _drop_unused_private_methods(module)
    for _ in range(3):  # pruning an attribute can orphan a class, which can orphan another attribute
        keep = _reachable(module, ctx.plan.architecture)
        body = [n for n in module.body if _defined_name(n) is None or _defined_name(n) in keep]
        module = module.with_changes(body=body)
        reader = _ReadAttributes()
        module.visit(reader)
        module = module.visit(_PruneAttributes(reader.cross_reads, _stateless_classes(module)))
    body, relative = [], []
    for node in module.body:
        if isinstance(node, cst.SimpleStatementLine):  # `from .a import x; import y` splits
            ours = [s for s in node.body if isinstance(s, cst.ImportFrom) and s.relative]
            relative += ours
            if ours:
                rest = [s for s in node.body if s not in ours]
                if not rest:
                    continue
                node = node.with_changes(body=[s.with_changes(semicolon=cst.MaybeSentinel.DEFAULT) for s in rest])
        body.append(node)
    module = module.with_changes(body=body)
    still_used = t.names_used(module) - {c for c in configs}
    carried = "".join(
        f"from {_absolute(imp, ctx.modeling_file)} import {name}\n"
        for imp in relative if not isinstance(imp.names, cst.ImportStar)
        for name in (a.evaluated_name for a in imp.names if (a.evaluated_alias or a.evaluated_name) in still_used)
    )
    configs_and_carried = "".join(f"from transformers import {c}\n" for c in configs) + carried
    config_imports = configs_and_carried
    if config_imports:
        at = max(i for i, n in enumerate(module.body) if isinstance(n, cst.SimpleStatementLine)
                 and isinstance(n.body[0], (cst.Import, cst.ImportFrom))) + 1
        module = module.with_changes(body=[*module.body[:at], *t.stmts(config_imports), *module.body[at:]])
    return PassResult(module=module, matches=len(hf_names))
