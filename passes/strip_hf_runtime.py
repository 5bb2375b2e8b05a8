"""Remove what vLLM does not use from the Hugging Face source.

Matches what is left of the Transformers runtime after the other passes:

* decorators and base classes imported from Transformers internals (relative imports such
  as ``@auto_docstring``, ``GradientCheckpointingLayer``) -> dropped / ``nn.Module``; class
  attributes only transformers' runtime reads (``_can_record_outputs``) -> dropped;
  ``super().__init__(config)`` -> ``super().__init__()``;
* relative imports: the model's configuration class becomes
  ``from transformers import LlamaConfig`` (Hub custom code: its base, ``PretrainedConfig``);
  helpers the carried source still uses (``ACT2FN``) are imported from their absolute
  module (custom code: refused, the repository's modules are not importable); every other
  import goes;
* top-level definitions no longer reachable from the architecture class (rotary helpers,
  ``repeat_kv``, ``eager_attention_forward``, the HF norm and rotary classes, the
  ``PreTrainedModel`` and task-head classes, ``logger``, ``__all__``);
* methods nothing calls any more: private ones (``_split_heads``, replaced with its use),
  and any but ``forward`` and torch's hooks in the layer classes (ERNIE-4.5's
  ``rope_attn``/``core_attn``, orphaned by the rewritten forward);
* torch's ``load_state_dict`` hooks the source registers (Mamba-2's ``load_hook``): vLLM
  loads through ``load_weights``, never ``load_state_dict``;
* ``self.x = ...`` assignments in ``__init__`` whose attribute nothing reads any more
  (``self.is_causal``, ``self.attention_dropout``, ``self.gradient_checkpointing``, an
  ``nn.Dropout``...).

Emits the same module minus those; kept classes keep their names, docstrings and comments.

Preconditions: none; removal is by reachability, so nothing the model uses can go.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
import torch

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.module_setups import without_registrations_of_dropped, without_unused_setups
from hfrewrite.emit.pass_api import PassContext, PassResult
from hfrewrite.emit.relative_imports import relative_imports, with_absolute_imports
from hfrewrite.emit.shared_matchers import NN_MODULE, SUPER_INIT
from hfrewrite.emit.torch_names import builds_a_class

NAME = "strip_hf_runtime"
# Attributes vLLM itself reads from the model classes (those built from `vllm_config`),
# including its MixtureOfExperts protocol.
READ_BY_VLLM = {
    "config",
    "make_empty_intermediate_tensors",
    "moe_layers",
    "num_moe_layers",
    "num_expert_groups",
    "num_logical_experts",
    "num_physical_experts",
    "num_local_physical_experts",
    "num_routed_experts",
    "num_shared_experts",
    "num_redundant_experts",
}
# Class attributes only transformers' runtime reads (XGLMModel's output recorders)
HF_CLASS_HOOKS = frozenset({"_can_record_outputs"})
# Modules without parameters or buffers, and functions that only compute: an unread
# attribute whose value builds nothing else goes (`self.attn_dropout = nn.Dropout(p)`).
EMPTY_MODULES = frozenset({"nn.Dropout", "torch.nn.Dropout", "nn.Identity", "torch.nn.Identity"})
PURE_CALLS = frozenset({"getattr", "max", "min", "int", "float", "math.sqrt", "math.log"}) | EMPTY_MODULES


def _defined_name(node: cst.CSTNode) -> str | None:
    if isinstance(node, (cst.ClassDef, cst.FunctionDef)):
        return node.name.value
    if isinstance(node, cst.SimpleStatementLine) and isinstance(node.body[0], (cst.Assign, cst.AnnAssign)):
        small = node.body[0]
        target = small.targets[0].target if isinstance(small, cst.Assign) else small.target
        return target.value if isinstance(target, cst.Name) else None
    return None


class _DropHfRuntime(cst.CSTTransformer):
    def __init__(self, hf_names: set[str]) -> None:
        self.hf_names = hf_names

    def leave_ClassDef(self, original, updated):
        decorators = [
            d
            for d in updated.decorators
            if t.dotted(getattr(d.decorator, "func", d.decorator)) not in self.hf_names
        ]
        bases = [b for b in updated.bases if t.dotted(b.value) not in self.hf_names]
        if len(bases) != len(updated.bases) and not any(m.matches(b.value, NN_MODULE) for b in bases):
            bases = [cst.Arg(t.expr("nn.Module")), *bases]
        updated = updated.with_changes(decorators=decorators, bases=bases)
        body = [s for s in updated.body.body if _defined_name(s) not in HF_CLASS_HOOKS]
        if len(body) != len(updated.body.body):
            if body and _defined_name(updated.body.body[0]) in HF_CLASS_HOOKS:
                body[0] = body[0].with_changes(leading_lines=())  # (the class's first line now)
            updated = updated.with_changes(body=updated.body.with_changes(body=body))
        init = t.find_method(updated, "__init__")
        if [t.code(b.value) for b in bases] == ["nn.Module"] and init is not None:
            updated = t.set_method(updated, init.visit(_NoSuperArgs()))  # nn.Module.__init__ takes no config
        return updated

    def visit_FunctionDef(self, node):
        return False  # only its decorators change: the body is not walked

    def leave_FunctionDef(self, original, updated):
        decorators = [
            d
            for d in updated.decorators
            if t.dotted(getattr(d.decorator, "func", d.decorator)) not in self.hf_names
        ]
        return updated.with_changes(decorators=decorators)


class _NoSuperArgs(cst.CSTTransformer):
    def visit_FunctionDef(self, node):
        return node.name.value == "__init__"  # not into nested functions

    def leave_Call(self, original, updated):
        if m.matches(updated.func, SUPER_INIT) and updated.args:
            return updated.with_changes(args=[])
        return updated


class _PerNode:
    """A function of a node, computed once per node object: the fixpoint loop in
    ``_without_unreachable`` rebuilds the module each round but reuses every node it did not
    change."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.cache: dict[int, tuple[cst.CSTNode, object]] = {}

    def __call__(self, node: cst.CSTNode):
        hit = self.cache.get(id(node))
        if hit is None or hit[0] is not node:
            hit = self.cache[id(node)] = (node, self.fn(node))
        return hit[1]


def _reachable(module: cst.Module, root: str, names_used=t.names_used) -> set[str]:
    defs = {n: node for node in module.body if (n := _defined_name(node))}
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in defs:
            continue
        seen.add(name)
        todo.extend(names_used(defs[name]) - seen)
    return seen


_PERSISTENT = m.Arg(keyword=m.Name("persistent"), value=m.Name("True"))


def _calls_and_persistence(cls: cst.ClassDef) -> tuple[set[str], bool]:
    """The dotted names a class calls, and whether it registers a persistent buffer."""
    calls = [n for n in t.walk(cls) if isinstance(n, cst.Call)]
    persistent = any(m.matches(a, _PERSISTENT) for c in calls for a in c.args)
    return {t.dotted(c.func) or "" for c in calls}, persistent


def _stateless_classes(module: cst.Module, calls_of=_calls_and_persistence) -> set[str]:
    """Module classes that hold no checkpoint state: no parameters, no persistent buffers,
    no layers (HF's rotary embedding). Dropping an unused one cannot orphan a weight."""
    classes = {n.name.value: n for n in module.body if isinstance(n, cst.ClassDef)}

    def holds_state(cls: cst.ClassDef) -> bool:
        calls, persistent = calls_of(cls)
        layers = {c for c in calls if builds_a_class(c)} - EMPTY_MODULES - {"nn.Buffer", "nn.Module"}
        return bool(
            persistent
            or layers
            or any(c.endswith("Parameter") for c in calls)
            or calls & (set(classes) - {cls.name.value})
        )

    return {name for name, cls in classes.items() if not holds_state(cls)}


_EMPTY_LIST = m.Call(func=m.Attribute(value=m.Name("nn"), attr=m.Name("ModuleList")), args=[])


class _PruneAttributes(cst.CSTTransformer):
    """Drop `self.x = ...` from a class's __init__ when nothing reads `self.x` in that class
    and no other class reads it through a submodule (`self.model.x`). A value that builds
    something is dropped only when it is a stateless class of this module, so the set of
    checkpoint weights never changes. Applied to one ``__init__``; ``read``: what is read."""

    def __init__(self, read: set[str], stateless: set[str]) -> None:
        self.read = read
        self.stateless = stateless
        self.pruned = 0
        self.depth = 0

    def visit_FunctionDef(self, node):
        self.depth += 1
        return self.depth == 1  # nested functions keep their assignments

    def leave_FunctionDef(self, original, updated):
        self.depth -= 1
        return updated

    def leave_SimpleStatementLine(self, original, updated):
        buffer = _transient_buffer(updated)
        if buffer is not None and buffer not in self.read:  # a cache the rewrite no longer reads
            self.pruned += 1
            return cst.RemoveFromParent()
        attr = t.self_attr_assigned(updated)
        if attr and attr not in self.read:
            value = t.assigned_value(updated)
            builds = [c for c in _calls(value) if c not in PURE_CALLS]
            if m.matches(value, _EMPTY_LIST) or all(c in self.stateless for c in builds):
                self.pruned += 1
                return cst.RemoveFromParent()
        return updated

    def leave_For(self, original, updated):
        """A loop that only fills a list nothing reads with stateless modules (Granite-SWA's
        ``self.rotary_embs.append(RotaryEmbedding(...))``), binding locals meanwhile."""
        if self.depth != 1 or not self._fills_unread_list(updated.body.body):
            return updated
        self.pruned += 1
        return cst.RemoveFromParent()

    def _fills_unread_list(self, body) -> bool:
        appended = [_self_append(s.body[0]) for s in body if isinstance(s, cst.SimpleStatementLine)]
        lists = {a.value.func.value.attr.value for a in appended if a is not None}
        if not lists or lists & self.read or any(not isinstance(s, cst.SimpleStatementLine) for s in body):
            return False
        for s in body:
            if _self_append(s.body[0]) is None and (
                len(s.body) != 1 or not isinstance(s.body[0], cst.Assign) or "self" in t.names_used(s)
            ):
                return False  # only locals bound beside the appends
        built = [c for c in _calls(cst.Module(body=list(body))) if builds_a_class(c)]
        return all(c in self.stateless for c in built)


_BUFFER = m.SimpleStatementLine(
    body=[
        m.Expr(
            m.Call(
                func=m.Attribute(value=m.Name("self"), attr=m.Name("register_buffer")),
                args=[
                    m.Arg(value=m.SimpleString()),
                    m.Arg(),
                    m.Arg(keyword=m.Name("persistent"), value=m.Name("False")),
                ],
            )
        )
    ]
)


_BUFFER_ATTR = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(m.Attribute(value=m.Name("self")))],
            value=m.Call(
                func=m.Attribute(value=m.Name("nn"), attr=m.Name("Buffer")),
                args=[m.ZeroOrMore(), m.Arg(keyword=m.Name("persistent"), value=m.Name("False"))],
            ),
        )
    ]
)


def _transient_buffer(node: cst.CSTNode) -> str | None:
    """``x`` of ``self.register_buffer("x", value, persistent=False)`` or of
    ``self.x = nn.Buffer(value, persistent=False)``: a buffer no checkpoint holds (an
    inverse-frequency or mask cache), or None."""
    if m.matches(node, _BUFFER_ATTR):
        return node.body[0].targets[0].target.attr.value
    if not m.matches(node, _BUFFER):
        return None
    return node.body[0].value.args[0].value.evaluated_value


def _class_reads(cls: cst.ClassDef) -> tuple[set[str], set[str]] | None:
    """(attributes its ``__init__`` assigns, attributes the class reads), None without one."""
    init = t.find_method(cls, "__init__")
    if init is None:
        return None
    assigned = {
        a
        for n in t.walk(init)
        if isinstance(n, cst.SimpleStatementLine) and (a := t.self_attr_assigned(n) or _transient_buffer(n))
    }
    self_reads, _ = _attribute_reads(cls)
    model_class = "vllm_config" in t.names_used(init.params)
    return assigned, self_reads | (READ_BY_VLLM if model_class else set())


def _prune_class(
    cls: cst.ClassDef, cross_reads: set[str], stateless: set[str], reads_of=_class_reads
) -> tuple[cst.ClassDef, int]:
    """``cls`` without the ``__init__`` assignments nothing reads, and how many went. Only a
    class with such an assignment is rewritten (the others are not walked twice)."""
    facts = reads_of(cls)
    if facts is None:
        return cls, 0
    assigned, read = facts
    read = read | cross_reads
    if not assigned - read:
        return cls, 0
    init = t.find_method(cls, "__init__")
    prune = _PruneAttributes(read, stateless)
    pruned = init.visit(prune)
    return (t.set_method(cls, pruned) if prune.pruned else cls), prune.pruned


def _calls(node: cst.CSTNode) -> list[str]:
    return [t.dotted(n.func) or "?" for n in t.walk(node) if isinstance(n, cst.Call)]


def _attribute_reads(node: cst.CSTNode) -> tuple[set[str], set[str]]:
    """`self.x` reads, and `<other>.x` reads of other objects (a class reaching into a
    submodule, `self.model.embed_tokens`, or into a block, `block.n_logical_experts`);
    reads of config (`self.config.x` too) and library attributes do not count, nor does the target `self.x` of
    an assignment (its value may read)."""
    self_reads: set[str] = set()
    cross_reads: set[str] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if (appended := _self_append(current)) is not None:  # filling a list is no read of it
            stack.extend(a.value for a in appended.value.args)
            continue
        if isinstance(current, cst.Assign):
            stack.append(current.value)
            stack.extend(
                target
                for target in current.targets
                if not (isinstance(target.target, cst.Attribute) and t.dotted(target.target.value) == "self")
            )
            continue
        if isinstance(current, cst.Attribute):
            base = t.dotted(current.value) or ""
            if base == "self":
                self_reads.add(current.attr.value)
            elif (
                base
                and base.split(".")[0] not in ("config", "torch", "nn", "F")
                and not base.endswith("_config")
                and not base.startswith("self.config")
            ):
                # another object's attribute: `self.model.embed_tokens`, `block.n_logical_experts`
                cross_reads.add(current.attr.value)
        stack.extend(t.children(current))
    return self_reads, cross_reads


_SELF_APPEND = m.Expr(
    m.Call(func=m.Attribute(value=m.Attribute(value=m.Name("self")), attr=m.Name("append")))
)


def _self_append(node: cst.CSTNode) -> cst.Expr | None:
    """``node`` when it is the statement ``self.x.append(...)``, else None."""
    return node if m.matches(node, _SELF_APPEND) else None


def _cross_reads(node: cst.CSTNode) -> set[str]:
    return _attribute_reads(node)[1]


_MODULE_METHODS = frozenset(dir(torch.nn.Module))


def _drop_unused_methods(module: cst.Module) -> tuple[cst.Module, int]:
    """Methods no code refers to any more: private helpers (``_split_heads``) of any class,
    and any method but ``forward`` of the layer classes (``nn.Module``s not built from
    ``vllm_config``, which vLLM itself only calls): the rewritten forward replaced their only
    use (ERNIE-4.5's ``rope_attn``/``core_attn``). Dunder methods are never dropped."""
    used = {n.attr.value for n in t.walk(module) if isinstance(n, cst.Attribute)}

    def layer_class(cls: cst.ClassDef) -> bool:
        init = t.find_method(cls, "__init__")
        return any(t.dotted(b.value) in ("nn.Module", "torch.nn.Module") for b in cls.bases) and not (
            init is not None and "vllm_config" in t.names_used(init.params)
        )

    def unused(member: cst.CSTNode, layer: bool) -> bool:
        if not isinstance(member, cst.FunctionDef) or member.decorators:
            return False
        name = member.name.value
        private = name.startswith("_") and not name.startswith("__")
        # (overrides of nn.Module's own methods, extra_repr, are torch's to call)
        own = layer and not name.startswith("_")
        return (private or own) and name not in used and name not in _MODULE_METHODS

    body, dropped = [], 0
    for node in module.body:
        if isinstance(node, cst.ClassDef):
            layer = layer_class(node)
            members = [m for m in node.body.body if not unused(m, layer)]
            dropped += len(node.body.body) - len(members)
            node = node.with_changes(body=node.body.with_changes(body=members)) if dropped else node
        body.append(node)
    return module.with_changes(body=body), dropped


_AUTO_CLASS = m.SimpleStatementLine(
    body=[m.Expr(m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("register_for_auto_class"))))]
)


def _registers_auto_class(node: cst.CSTNode) -> bool:
    """``XForCausalLM.register_for_auto_class("AutoModelForCausalLM")``: transformers' Auto
    classes at import time (Hub custom code), nothing vLLM runs."""
    return m.matches(node, _AUTO_CLASS)


_LOAD_HOOK = m.SimpleStatementLine(
    body=[
        m.Expr(
            m.Call(
                func=m.Attribute(
                    value=m.Name("self"),
                    attr=m.Name("_register_load_state_dict_pre_hook")
                    | m.Name("register_load_state_dict_post_hook")
                    | m.Name("register_load_state_dict_pre_hook"),
                )
            )
        )
    ]
)


class _WithoutLoadHooks(cst.CSTTransformer):
    """``self._register_load_state_dict_pre_hook(self.load_hook)`` (Mamba-2's renaming of old
    checkpoint names): torch's ``load_state_dict`` hooks, which vLLM never calls (its
    load_weights reads the checkpoint); a checkpoint needing that renaming stops on the name."""

    def leave_SimpleStatementLine(self, original, updated):
        return cst.RemoveFromParent() if m.matches(updated, _LOAD_HOOK) else updated


def without_orphans(module: cst.Module, root: str) -> cst.Module:
    """``module`` without what a later rewrite left unread: the methods, definitions and
    ``__init__`` assignments ``root`` (the causal LM's class) no longer reaches."""
    return _without_unreachable(module, root, _PerNode(t.names_used))


def _without_unreachable(module: cst.Module, root: str, names_used) -> cst.Module:
    """Unused methods, definitions ``root`` no longer reaches and ``__init__`` assignments
    nothing reads, dropped round after round until a round drops nothing."""
    calls_of, reads_of = _PerNode(_calls_and_persistence), _PerNode(_class_reads)
    cross_reads_of = _PerNode(_cross_reads)
    for _ in range(4):  # pruning an attribute can orphan a class or method, which can orphan another
        module, methods = _drop_unused_methods(module)
        keep = _reachable(module, root, names_used)
        body = [n for n in module.body if _defined_name(n) is None or _defined_name(n) in keep]
        dropped = len(body) != len(module.body)
        module = module.with_changes(body=body)
        module, pruned = _prune_attributes(module, calls_of, reads_of, cross_reads_of)
        if not (dropped or pruned or methods):
            break  # a fixpoint: nothing left to orphan
    return module


def _prune_attributes(module: cst.Module, calls_of, reads_of, cross_reads_of) -> tuple[cst.Module, int]:
    """Every class without the ``__init__`` assignments nothing reads, and how many went."""
    cross_reads = set().union(*(cross_reads_of(n) for n in module.body))
    stateless, body, pruned = _stateless_classes(module, calls_of), [], 0
    for node in module.body:
        if isinstance(node, cst.ClassDef):
            node, count = _prune_class(node, cross_reads, stateless, reads_of)
            pruned += count
        body.append(node)
    return module.with_changes(body=body), pruned


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    hf_names, configs = relative_imports(module)
    module = module.with_changes(body=[n for n in module.body if not _registers_auto_class(n)])
    module = module.visit(_DropHfRuntime(hf_names)).visit(_WithoutLoadHooks())
    names_used = _PerNode(t.names_used)
    module = _without_unreachable(module, ctx.plan.architecture, names_used)
    module = without_unused_setups(module, names_used)
    module = without_registrations_of_dropped(module)
    module = with_absolute_imports(
        module, configs, names_used, ctx.custom_code, ctx.modeling_file, ctx.shim_helpers
    )
    return PassResult(module=module, matches=len(hf_names))
