"""The value-carrying torch.fx tracer that analysis reads.

transformers 5.x ships no fx tracer, and plain ``torch.fx.symbolic_trace`` fails on its
modeling code: forwards are wrapped by decorators (``co_varnames is too small``) and
shapes are iterated (``(*input_shape, -1, self.head_dim)``). This tracer runs the module
on small example tensors while it records: every node keeps the concrete value it
computed in ``node.meta["value"]``, so ``.shape``, ``len``, iteration and ``if`` on a
traced value use the real value (and are baked into the graph as constants).

Leaves (one node each, never traced through): ``nn.Linear``, ``nn.Embedding``, norm
modules (class name ending in ``Norm``), activation modules, stacked MoE experts, and the attention function
:func:`opaque_attention`, which a model reaches through ``config._attn_implementation
= ATTN_IMPLEMENTATION``. Everything else is inlined; each node's
``meta["nn_module_stack"]`` says which submodules it ran in.
"""

from __future__ import annotations

import inspect
import operator
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch import nn
from torch.fx import Graph, GraphModule, Node, Proxy, Tracer
from torch.fx._symbolic_trace import _maybe_revert_all_patches
from torch.fx.node import map_aggregate
from torch.fx.proxy import Attribute
from torch.utils import _pytree as pytree
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

from hfrewrite.analyze.causal_mask import causal_mask
from hfrewrite.analyze.einops_backend import register_einops_backend
from hfrewrite.analyze.gqa_expansion import before_expansion, permuted_before_expansion
from hfrewrite.analyze.leaf_modules import is_leaf
from hfrewrite.analyze.linear_classes import is_linear
from hfrewrite.analyze.plan import LinearFact
from hfrewrite.analyze.scripted import python_for_scripted
from hfrewrite.analyze.source_frames import source_frames_and_lines
from hfrewrite.analyze.traced_factories import recorded_factories

ATTN_IMPLEMENTATION = "hfrewrite_opaque"


def opaque_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention leaf: one graph node with args (module, q, k, v, mask) and kwargs.

    Outside tracing it computes SDPA attention, so a traced graph still runs. A graph
    cannot name its own root module: when the traced root calls it, the node's module
    argument is None (its value is still computed with the module).
    """
    for arg in (query, key, value):
        if isinstance(arg, ValueProxy):
            named = None if module is arg.tracer.root else module
            return arg.tracer.create_proxy(
                "call_function",
                opaque_attention,
                (named, query, key, value, attention_mask),
                kwargs,
            )
    if getattr(module, "num_key_value_groups", None) != query.shape[1] // key.shape[1]:
        key, value = _grouped(query, key, value)  # custom code need not name its GQA ratio
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, opaque_attention)
# Models that compute attention by hand in their own forward (BLOOM) read the mask
# transformers builds for the implementation: the eager one, as Hugging Face runs them
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, eager_mask)

# Softmax attention computed by torch itself, outside transformers' attention interface
# (custom code often calls it directly): the leaf ``causal_sdpa`` when the call is proven
# causal self-attention, else seen but not taken for the attention leaf.
_DIRECT_SDPA = (torch.nn.functional.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
DIRECT_SDPA_REASON = (
    "calls torch's scaled_dot_product_attention directly, not through transformers' attention "
    "interface (ALL_ATTENTION_FUNCTIONS), with a mask, dropout or lengths that do not prove "
    "causal self-attention"
)


def is_direct_sdpa(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in _DIRECT_SDPA


def causal_sdpa(module, query, key, value, attention_mask, scaling=None, alibi=None, sliding_window=None):
    """The attention leaf for a direct ``scaled_dot_product_attention(q, k, v,
    is_causal=True)`` over queries and keys of one length (no mask, no dropout): causal
    self-attention, what vLLM's ``Attention`` computes. k and v are taken before any GQA
    expansion (kv head ``h // groups`` serves query head ``h``); returns what
    ``opaque_attention`` returns, ``([batch, seq, heads, head_dim], None)``, from the same
    arguments (``module`` and ``attention_mask`` are always None)."""
    key, value = _grouped(query, key, value)
    if alibi is not None:  # with ALiBi's bias (analyze/alibi.py): the factor's expression
        from hfrewrite.analyze.alibi import FACTORS, with_alibi

        factor = (1.0, query.shape[-1] ** -0.5)[FACTORS.index(alibi)]
        return with_alibi(query, key, value, factor).transpose(1, 2), None
    if sliding_window is not None:  # over the last keys alone (analyze/mask_window.py)
        from hfrewrite.analyze.mask_window import windowed_sdpa

        return windowed_sdpa(query, key, value, scaling, sliding_window).transpose(1, 2), None
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2), None


ATTENTION_LEAVES = (opaque_attention, causal_sdpa)


def _grouped(query, key, value):
    """k and v with each kv head repeated for its group: query head h reads kv head h // groups."""
    groups = query.shape[1] // key.shape[1]
    return (repeat_kv(key, groups), repeat_kv(value, groups)) if groups > 1 else (key, value)


def is_attention_leaf(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in ATTENTION_LEAVES


class ValueProxy(Proxy):
    """A proxy that also knows the concrete value its node computed."""

    @property
    def value(self) -> Any:
        return self.node.meta["value"]

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.node.meta["value"], name)
        if isinstance(attr, torch.Tensor):
            return self.tracer.create_proxy("call_function", getattr, (self, name), {})
        if callable(attr):
            return Attribute(self, name)  # a method: recorded when called
        return attr  # shape, dtype, ndim...: the concrete value

    def __len__(self) -> int:
        return len(self.value)

    def __iter__(self):
        if isinstance(self.value, dict):
            return iter(self.value)
        return iter([self[i] for i in range(len(self.value))])

    def __bool__(self) -> bool:
        return bool(self.value)

    def __index__(self) -> int:
        """A size used as an index of a concrete tensor (``self.bias[:, :, :w.size(-2)]``,
        GPT-Neo's and GPT-1's masks): its value, as branches take theirs."""
        if isinstance(self.value, int) and not isinstance(self.value, bool):
            return self.value
        raise TypeError(f"{self.node.name} is not an integer")

    def keys(self):
        return self.value.keys()

    def __setitem__(self, key: Any, item: Any) -> None:
        """Recorded as ``operator.setitem``, and applied to the value."""
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, item), {})


def _value_of(arg: Any) -> Any:
    if isinstance(arg, Attribute):
        return getattr(_value_of(arg.root), arg.attr)
    if isinstance(arg, ValueProxy):
        return arg.value
    return arg


class ValueTracer(Tracer):
    """A Tracer whose proxies carry values; see the module docstring."""

    def __init__(self, args: tuple, kwargs: dict, layer_masks: bool = False) -> None:
        super().__init__(autowrap_modules=(), param_shapes_constant=False)
        self.layer_masks = layer_masks  # see causal_mask.causal_mask
        self.example = (args, kwargs)
        self.placeholders: list[torch.Tensor] = []
        self.returns_tuple: dict[str, bool] = {}  # submodule path -> its forward returned a tuple
        self.returns_list: dict[str, bool] = {}  # ... a list (GPT-1's `[a] + attn_outputs[1:]`)
        self.called_with: dict[str, tuple] = {}  # submodule path -> (args, kwargs) values, first call
        self.evaluating = False  # see traced_factories

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return is_leaf(m)

    def call_module(self, m, forward, args, kwargs):
        if m not in self.submodule_paths:  # built on the fly, e.g. ``ACT2FN[name](x)``
            return forward(*args, **kwargs)
        out = super().call_module(m, forward, args, kwargs)
        self.called_with.setdefault(
            self.submodule_paths[m], (_concrete(tuple(args)), _concrete(dict(kwargs)))
        )
        self.returns_tuple.setdefault(self.submodule_paths[m], isinstance(out, tuple | list))
        self.returns_list.setdefault(self.submodule_paths[m], isinstance(out, list))
        return out

    def proxy(self, node: Node) -> ValueProxy:
        return ValueProxy(node, self)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None) -> Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta["frames"], node.meta["lines"] = source_frames_and_lines()
        if kind == "get_attr":  # also those made for constants, parameters and modules
            with _maybe_revert_all_patches():
                node.meta["value"] = _get_attr(self.root, target)
        return node

    def create_proxy(
        self,
        kind,
        target,
        args,
        kwargs,
        name=None,
        type_expr=None,
        proxy_factory_fn=None,
    ):
        if kind == "call_function" and target in _DIRECT_SDPA:
            leaf = self._causal_sdpa(args, kwargs)
            if leaf is not None:
                return leaf
        mutated = _mutated(kind, target, args)
        before = mutated.node.meta["value"].clone() if mutated is not None else None
        value = self._evaluate(kind, target, args, kwargs)
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, self.proxy)
        proxy.node.meta["value"] = value
        if mutated is not None:
            # `out.add_(routed)` (Llama-4's MoE): the source's later reads of `out` read the
            # in-place op's node, and the node it mutated keeps its value from before
            mutated.node.meta["value"] = before
            mutated.node = proxy.node
        return proxy

    def _causal_sdpa(self, args: tuple, kwargs: dict) -> ValueProxy | None:
        """A direct SDPA call as the ``causal_sdpa`` leaf, in SDPA's output layout
        ``[batch, heads, seq, head_dim]``; None unless it is proven causal self-attention."""
        if len(args) > len(_SDPA_PARAMS) or set(kwargs) - set(_SDPA_PARAMS):
            return None
        p = {**dict(zip(_SDPA_PARAMS, args)), **kwargs}
        q, k, v = p["query"], p["key"], p["value"]
        if not all(isinstance(x, ValueProxy) and torch.is_tensor(x.value) for x in (q, k, v)):
            return None
        options = {key: p.get(key, default) for key, default in (("dropout_p", 0.0), ("is_causal", False))}
        scale = p.get("scale")
        mask = p.get("attn_mask")
        if mask is not None and causal_mask(mask, q.value.shape[-2], self.layer_masks):
            options["is_causal"], mask = True, None  # the mask spells out what is_causal means
        if (
            mask is not None
            or any(isinstance(x, Proxy) for x in (*options.values(), scale))
            or options != {"dropout_p": 0.0, "is_causal": True}
            or q.value.dim() != 4
            or k.value.shape[-2] != q.value.shape[-2]
        ):
            return None
        heads = q.value.shape[1]
        k, v = (self._unexpanded(x, heads) for x in (k, v))
        if k.value.shape[1] != v.value.shape[1]:
            return None  # k and v expanded differently
        out = self.create_proxy("call_function", causal_sdpa, (None, q, k, v, None), {"scaling": scale})
        return out[0].transpose(1, 2)

    def _unexpanded(self, x: ValueProxy, heads: int) -> ValueProxy:
        """k or v before a GQA expansion, in the attention's layout (ChatGLM expands its
        sequence-first k/v, then permutes them: the unexpanded value permuted the same way)."""
        node = before_expansion(x.node, heads)
        if node is not x.node:
            return ValueProxy(node, self)
        found = permuted_before_expansion(x.node, heads)
        return ValueProxy(found[0], self).permute(*found[1]) if found else x

    def _evaluate(self, kind: str, target: Any, args: tuple, kwargs: dict) -> Any:
        args = map_aggregate(args, _value_of)
        kwargs = map_aggregate(kwargs, _value_of)
        self.evaluating = True
        try:
            return self._run(kind, target, args, kwargs)
        finally:
            self.evaluating = False

    def _run(self, kind: str, target: Any, args: tuple, kwargs: dict) -> Any:
        with _maybe_revert_all_patches():  # run real modules, not the tracing patches
            if kind == "placeholder":
                return self.placeholders[-1]
            if kind == "get_attr":
                return _get_attr(self.root, target)
            if kind == "call_module":
                return self.root.get_submodule(target)(*args, **kwargs)
            if kind == "call_method":
                return getattr(args[0], target)(*args[1:], **kwargs)
            if kind == "call_function":
                if target is opaque_attention and args[0] is None:
                    args = (self.root, *args[1:])  # see opaque_attention
                return target(*args, **kwargs)
        raise AssertionError(f"unexpected node kind {kind}")

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        """Placeholders for the tensors in the example call; the rest stays concrete."""
        forward = inspect.unwrap(type(self.root).forward)
        params = list(inspect.signature(forward).parameters)[1:]
        leaves, spec = pytree.tree_flatten_with_path(self.example)
        values = []
        for path, leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                self.placeholders.append(leaf.clone())
                name = _placeholder_name(path, params)
                leaf = self.create_proxy("placeholder", name, (), {})
            values.append(leaf)
        args, kwargs = pytree.tree_unflatten(values, spec)

        def root(module):
            return forward(module, *args, **kwargs)

        return root, [self.root]


def _mutated(kind: str, target: Any, args: tuple) -> ValueProxy | None:
    """The proxy an in-place tensor method (``add_``, ``mul_``) is called on, else None."""
    if (
        kind != "call_method"
        or not (isinstance(target, str) and target.endswith("_"))
        or target.startswith("_")
    ):
        return None
    if not args or not isinstance(args[0], ValueProxy) or not torch.is_tensor(args[0].node.meta.get("value")):
        return None
    return args[0]


def _get_attr(root: nn.Module, target: str) -> Any:
    value: Any = root
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def _placeholder_name(path: tuple, params: list[str]) -> str:
    """A key path into ``(args, kwargs)`` -> ``position_embeddings_1``, ``arg0``..."""
    head, rest = path[1], pytree.keystr(path[2:])
    if path[0].idx == 1:
        first = head.key
    else:  # a positional argument: use the forward's parameter name when it has one
        first = params[head.idx] if head.idx < len(params) else f"arg{head.idx}"
    return re.sub(r"\W+", "_", f"{first}{rest}").strip("_")


@dataclass(frozen=True)
class Traced:
    """A traced module: its graph (values in ``node.meta["value"]``) and inputs."""

    module: nn.Module
    graph_module: GraphModule
    inputs: tuple[torch.Tensor, ...]  # the example tensors, in placeholder order
    returns_tuple: dict[str, bool] = field(default_factory=dict)  # submodule path -> returned a tuple
    returns_list: dict[str, bool] = field(default_factory=dict)  # (that tuple is a list)
    called_with: dict[str, tuple] = field(default_factory=dict)  # submodule path -> (args, kwargs) values

    @property
    def graph(self) -> Graph:
        return self.graph_module.graph

    def submodule(self, node: Node) -> nn.Module:
        """The module a ``call_module`` (or module ``get_attr``) node refers to."""
        return self.module.get_submodule(node.target)

    def nodes_in(self, path: str) -> list[Node]:
        """Nodes computed inside submodule ``path`` ("": all but I/O), in order."""
        return [
            n
            for n in self.graph.nodes
            if n.op not in ("placeholder", "output") and (not path or path in scopes(n))
        ]

    def outputs_of(self, path: str) -> list[Node]:
        """Nodes inside ``path`` whose value is used outside it, in graph order."""
        nodes = self.nodes_in(path)
        inside = set(nodes)
        return [n for n in nodes if any(u not in inside for u in n.users)]

    def linears_in(self, path: str) -> list[Node]:
        """``nn.Linear`` call nodes inside ``path``, in graph order."""
        return [n for n in self.nodes_in(path) if n.op == "call_module" and is_linear(self.submodule(n))]

    def linear_fact(self, node: Node, path: str) -> LinearFact:
        """The facts of a Linear call node, ``attr`` relative to submodule ``path``."""
        linear = self.submodule(node)
        return LinearFact(
            relative(node.target, path),
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
        )


def relative(target: str, path: str) -> str:
    """``self_attn.q_proj`` relative to ``self_attn`` -> ``q_proj``."""
    return target[len(path) + 1 :] if path else target


def scopes(node: Node) -> list[str]:
    """Qualified names of the modules a node ran in, outermost first."""
    return [q for q, _ in node.meta.get("nn_module_stack", {}).values()]


def top_scope(node: Node) -> str | None:
    """The outermost submodule a node ran in, or None at the root."""
    ran_in = scopes(node)
    return ran_in[0] if ran_in else None


def scope_below(node: Node, path: str) -> str | None:
    """The submodule directly inside ``path`` that ``node`` ran in, or None."""
    ran_in = scopes(node)
    if path not in ran_in:
        return None
    at = ran_in.index(path)
    return ran_in[at + 1] if at + 1 < len(ran_in) else None


def past_identity_dropouts(node: Node, traced: Traced, path: str) -> Node:
    """``node``, or the end of the chain of dropouts inside submodule ``path`` that
    follow it when each returned its input unchanged (inference mode: the identity)."""
    while len(node.users) == 1:
        user = next(iter(node.users))
        if path not in scopes(user) or not is_identity_dropout(user, traced):
            break
        node = user
    return node


def is_identity_dropout(node: Node, traced: Traced) -> bool:
    """A dropout call that returned its input unchanged (inference mode)."""
    if node.op == "call_module":
        is_dropout = isinstance(traced.submodule(node), nn.Dropout)
    else:
        is_dropout = node.op == "call_function" and node.target is torch.nn.functional.dropout
    if not is_dropout or not node.args or not isinstance(node.args[0], Node):
        return False
    before, after = value(node.args[0]), value(node)
    return torch.is_tensor(after) and torch.equal(before, after)


def _concrete(x: Any) -> Any:
    """``_value_of`` through tuples, lists and dicts."""
    if isinstance(x, dict):
        return {k: _concrete(y) for k, y in x.items()}
    return type(x)(map(_concrete, x)) if isinstance(x, tuple | list) else _value_of(x)


def value(node: Any) -> Any:
    """The concrete value a node computed (constants are their own value)."""
    return node.meta["value"] if isinstance(node, Node) else node


def trace(
    module: nn.Module, args: tuple = (), kwargs: dict | None = None, layer_masks: bool = False
) -> Traced:
    """Trace ``module(*args, **kwargs)``; tensors in args/kwargs become placeholders;
    ``layer_masks``: see ``causal_mask.causal_mask``.

    Tensors the forward creates (not parameters or buffers) are stored on ``module`` as
    ``_tensor_constant<N>`` attributes, as ``torch.fx`` does.
    """
    register_einops_backend(ValueProxy)  # once per process (setdefault), when tracing starts
    tracer = ValueTracer(tuple(args), dict(kwargs or {}), layer_masks)
    with torch.no_grad(), recorded_factories(tracer), python_for_scripted(module):
        graph = tracer.trace(module)
    gm = GraphModule(tracer.root, graph, type(module).__name__)
    return Traced(
        module, gm, tuple(tracer.placeholders), tracer.returns_tuple, tracer.returns_list, tracer.called_with
    )
