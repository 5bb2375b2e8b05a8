"""The calls of an attention ``forward`` the plan accounts for (``AttentionPlan.replaced_calls``):
the helpers, methods and torch functions whose every traced node the vLLM rewrite computes
itself, which ``passes/vllm_attention.py`` may therefore drop with the source's body."""

from __future__ import annotations

import inspect

from torch.fx import Node

from hfrewrite.analyze.block_output import hidden_output
from hfrewrite.analyze.dataflow import ancestors, path_nodes
from hfrewrite.analyze.identity_attributes import identity_attributes, identity_dropouts
from hfrewrite.analyze.source_frames import called_from
from hfrewrite.analyze.trace import Traced, causal_sdpa, relative, scopes


def replaced_calls(
    traced: Traced, path: str, scope: set[Node], feeders: dict, ends: dict, call: Node, o_node: Node
) -> tuple[str, ...]:
    """Names of the calls in the attention forward (functions it calls; methods and torch
    functions it calls itself) whose every traced node the plan accounts for: on the q/k
    paths from the projections to the end of the proven rope, computed from the position
    inputs alone (cos/sin), the attention call and the layout after it, or reaching no
    output (a GQA expansion the attention leaf looked through, attention written by hand
    that the leaf replaced; never an in-place op)."""
    accounted = _accounted(traced, scope, feeders, ends, call, o_node)
    sources = set(feeders.values())
    hidden = hidden_output(traced)  # what the next layer reads: weights returned beside are dead
    live = set(ancestors(hidden, None)) if hidden is not None else set()
    cls = type(traced.module.get_submodule(path))
    forward = inspect.unwrap(cls.forward).__code__
    methods = _own_methods(cls)
    verdicts: dict[str, bool] = {}
    for n in scope:
        if forward not in n.meta.get("frames", ()):
            continue
        accounted_for = n in accounted or not sources & set(ancestors(n, scope))
        for name in (x for x in _call_names(n, path, forward, methods) if x is not None):
            ok = accounted_for or (n not in live and not str(name).endswith("_"))  # never in place
            verdicts[name] = verdicts.get(name, True) and ok
    for name in _traceless_calls(traced, path, scope, forward, methods):
        verdicts.setdefault(name, True)
    return tuple(sorted(name for name, ok in verdicts.items() if ok))


def _accounted(
    traced: Traced, scope: set[Node], feeders: dict, ends: dict, call: Node, o_node: Node
) -> set[Node]:
    """The nodes the plan computes itself: the q/k paths up to the rope's end, the layout
    of v (and of q and k without a rope), the attention call and the layout after it."""
    accounted = {call, *path_nodes(o_node, call, scope)}
    for r, end in ends.items():
        accounted |= {*path_nodes(end, feeders[r], scope), end}
    for r, arg in zip("qkv", call.args[1:4]):  # layout only, checked: v's head split too
        if r not in ends and isinstance(arg, Node):
            accounted |= {*path_nodes(arg, feeders[r], scope), arg}
    return accounted | identity_dropouts(traced, scope, o_node)


def _call_names(n: Node, path: str, forward, methods: set) -> list[str | None]:
    """The names of the calls the forward made that ran ``n``."""
    # named as the forward calls it (``self._split_heads``), and, through the class's own
    # helpers, as their inlined body does (inline_helpers inlines ``self._project``)
    code, names = forward, []
    while True:
        helper = called_from(n, code)
        name = helper.co_name if helper is not None else _own_call_name(n)
        if helper is not None and helper.co_name == "forward":  # a submodule's (self.rotary_emb)
            name = _child_called(n, path) or name
        names.append(name)
        if helper not in methods:
            break
        code = helper
    child = _child_called(n, path) if n.op != "call_module" else None
    if child is not None and child not in names:
        names.append(child)  # a child module whose torch code left no frame (nn.Dropout)
    return names


def _traceless_calls(traced: Traced, path: str, scope: set[Node], forward, methods: set) -> list[str]:
    """The calls that traced no node at all: they computed constants."""
    # children called that traced no node at all (a rotary module slicing its cos/sin cache
    # by a length): they computed constants, which reach q and k only through the proven rope
    ran = {relative(q, path).split(".")[0] for n in scope for q in scopes(n) if q.startswith(f"{path}.")}
    found = []
    for called in traced.returns_tuple:
        child = relative(called, path) if called.startswith(f"{path}.") else ""
        if child and "." not in child and child not in ran:
            found.append(child)
    found += identity_attributes(traced.module.get_submodule(path))
    # own methods the forward names that traced no node (GPT-J's _get_embed_positions, a
    # buffer repeated by a size): constants, reaching the output only through accounted nodes
    framed = {code for n in scope for code in n.meta.get("frames", ())}
    found += [code.co_name for code in methods - framed if code.co_name in forward.co_names]
    return found


def _own_methods(cls: type) -> set:
    """Code objects of the methods the attention class defines or inherits from classes of
    the model's source (not ``nn.Module``'s), ``forward`` left out."""
    found = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch."):
            break
        for name, member in vars(klass).items():
            if name != "forward" and inspect.isfunction(member):
                found.add(inspect.unwrap(member).__code__)
    return found


def _child_called(n: Node, path: str) -> str | None:
    """The attribute of the attention's child module ``n`` ran in (``rotary_emb``)."""
    inner = [q for q in scopes(n) if q.startswith(f"{path}.") or (not path and q)]
    return relative(inner[0], path).split(".")[0] if inner else None


def _own_call_name(n: Node) -> str | None:
    """How the forward spells a call it makes itself: ``x.<method>(...)``, ``torch.<fn>(...)``."""
    if n.op == "call_method":
        return n.target
    if n.op == "call_function":
        return (
            "scaled_dot_product_attention" if n.target is causal_sdpa else getattr(n.target, "__name__", None)
        )
    return None
