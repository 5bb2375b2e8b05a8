"""What ``passes/fuse_experts.py`` emits for experts beyond transformers' stacked
``[gate; up]`` layout: for flat ``[E * I, H]`` parameters (dbrx: ``self.experts =
DbrxExperts(config.ffn_config)`` holding ``mlp.w1``/``v1``/``w2``) the sizes, the activation
and the renormalisation as the source's classes compute them, each class's ``config``
parameter replaced by the expression the block passes it; for gpt_oss's experts the layout
description and the guard on swigluoai's constants; the sizes of transformers' stacked
experts; whether a ModuleList's experts are built with the block's own config."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.shared_matchers import builds, nn_call
from hfrewrite.errors import HfrewriteError

NAME = "fuse_experts"


class _Substitute(cst.CSTTransformer):
    """Names replaced by expressions (a call's arguments for its parameters); attribute
    names (the ``x`` of ``a.x``) are not names."""

    def __init__(self, bound: dict[str, cst.BaseExpression]) -> None:
        self.bound, self.attrs = bound, set()

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.attrs.add(id(node.attr))

    def leave_Name(self, original, updated):
        return updated if id(original) in self.attrs else self.bound.get(updated.value, updated)


def _bound(expr: str, bound: dict[str, cst.BaseExpression]) -> str:
    """``expr`` of a class built with its parameters bound to these arguments."""
    return t.code(t.expr(expr).visit(_Substitute(bound)))


def _built_with_config(module: cst.Module, call: cst.BaseExpression | None, cls: str, where: str):
    """(class, its config parameter name, the expression passed for it) of ``Cls(<arg>)``."""
    if t.call_name(call) != cls or len(call.args) != 1:
        raise HfrewriteError(f"{where}: {NAME}: not built as {cls}(<config>)")
    klass = t.find_class(module, cls)
    params = [p.name.value for p in t.find_method(klass, "__init__").params.params]
    if len(params) != 2:
        raise HfrewriteError(f"{where}: {NAME}: {cls}.__init__ takes more than a config")
    return klass, params[1], call.args[0].value


def flat_sources(module: cst.Module, built: dict, moe, block_exprs: dict[str, str]):
    """(sizes, activation, renormalize, guards) for ``FusedMoEFactory``."""
    name = moe.module_class
    experts_cls, param, arg = _built_with_config(module, built.get(moe.experts), moe.experts_class, name)
    experts = t.init_exprs(experts_cls)
    sizes = {}
    for size, attr in zip(("num_experts", "hidden_size", "intermediate_size"), moe.size_attrs):
        expr = experts.get(attr)
        if expr is None or "self." in expr:
            raise HfrewriteError(
                f"{name}: {NAME}: {moe.experts_class}.{attr} ({size}) is not set from its config"
            )
        sizes[size] = _bound(expr, {param: arg})
    sizes = {"num_experts": sizes["num_experts"], "top_k": block_exprs.get(moe.top_k_attr, ""), **sizes}
    if not sizes["top_k"] or "self." in sizes["top_k"]:
        raise HfrewriteError(f"{name}: {NAME}: self.{moe.top_k_attr} (top_k) is not set from the config")
    act = _activation(module, experts_cls, param, arg, moe)
    renormalize, guards = _norm_renormalize(t.find_class(module, name), block_exprs, moe)
    return sizes, act, renormalize, guards


def _activation(module: cst.Module, experts_cls: cst.ClassDef, param: str, arg, moe) -> str:
    """The ``ACT2FN[...]`` key of the class holding the flat parameters, as an expression."""
    holder, holder_param = experts_cls, param
    child = moe.flat_experts[0].rpartition(".")[0]
    if child:  # the parameters live in a child built with the same config (dbrx's mlp)
        init = t.find_method(experts_cls, "__init__")
        call = next((t.assigned_value(s) for s in init.body.body if t.self_attr_assigned(s) == child), None)
        holder, sub_param, sub_arg = _built_with_config(
            module, call, t.call_name(call) or "?", moe.module_class
        )
        if t.dotted(sub_arg) != param:
            raise HfrewriteError(
                f"{moe.module_class}: {NAME}: self.{child} is not built with the same config"
            )
        holder_param = sub_param
    init = t.find_method(holder, "__init__")
    keys = [
        s.body[0].value.slice[0].slice.value
        for s in init.body.body
        if isinstance(s, cst.SimpleStatementLine)
        and isinstance(s.body[0], cst.Assign)
        and m.matches(s.body[0].value, m.Subscript(value=m.Name("ACT2FN")))
    ]
    if len(keys) != 1:
        raise HfrewriteError(f"{moe.module_class}: {NAME}: the experts' activation is not one ACT2FN[...]")
    key = keys[0]
    if isinstance(key, cst.Name):  # a local: `name = config.ffn_act_fn.get("name", "silu")`
        locals_ = {
            s.body[0].targets[0].target.value: s.body[0].value
            for s in init.body.body
            if isinstance(s, cst.SimpleStatementLine)
            and isinstance(s.body[0], cst.Assign)
            and isinstance(s.body[0].targets[0].target, cst.Name)
        }
        key = locals_.get(key.value)
    if key is None or "self." in t.code(key):
        raise HfrewriteError(
            f"{moe.module_class}: {NAME}: the experts' activation is not set from the config"
        )
    return t.code(key.visit(_Substitute({holder_param: arg})))


def _norm_renormalize(block: cst.ClassDef, block_exprs: dict[str, str], moe) -> tuple[str, str]:
    """The condition under which the block divides the routing weights by their
    ``torch.norm(w, p=P)``, and a guard refusing configs where P is not 1: the replay
    proved the L1 norm of the (positive) softmax weights, which is vLLM's renormalisation."""
    norm = m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("norm")))
    found = []
    for condition, divisor in t.guarded_divisions(block, lambda d: bool(m.findall(d, norm))):
        call = m.findall(divisor, norm)[0]
        p = next((a.value for a in call.args if a.keyword and a.keyword.value == "p"), None)
        found.append((condition, p))
    if not found:
        if moe.renormalize:
            raise HfrewriteError(
                f"{moe.module_class}: {NAME}: the source's renormalisation disagrees with the trace"
            )
        return "False", ""
    if len(found) > 1 or found[0][1] is None or not moe.renormalize:
        raise HfrewriteError(
            f"{moe.module_class}: {NAME}: the routing weights are not divided once by one norm"
        )
    condition, p = found[0][0], t.code(found[0][1])
    for attr, expr in block_exprs.items():
        condition, p = condition.replace(f"self.{attr}", expr), p.replace(f"self.{attr}", expr)
    if "self." in condition + p:
        raise HfrewriteError(f"{moe.module_class}: {NAME}: renormalisation depends on {condition} / {p}")
    guard = (
        f"if {condition} and {p} != 1:\n"
        f'    raise NotImplementedError("hfrewrite: {moe.module_class} was converted for weights '
        f'renormalised by their sum (p=1)")\n'
    )
    return condition, guard


def layout(moe) -> str:
    """How the stacked experts hold gate and up, as the replay proved it."""
    return moe.experts_layout.label + (", biased" if moe.experts_bias else "")


def swiglu_guard(module: cst.Module, moe) -> str:
    """Refuse configs whose swigluoai alpha or limit is not the one vLLM's kernels use."""
    if moe.swiglu_attrs is None:
        return ""
    experts = t.init_exprs(t.find_class(module, moe.experts_class))
    alpha, limit = (experts.get(a, "") for a in moe.swiglu_attrs)
    if not alpha or not limit or "self." in alpha + limit:
        raise HfrewriteError(
            f"{moe.module_class}: {NAME}: swigluoai's alpha and limit are not set from the config"
        )
    return (
        f"if ({alpha}, {limit}) != (1.702, 7.0):\n"
        f'    raise NotImplementedError("hfrewrite: vLLM\'s swigluoai experts use alpha 1.702 and limit 7.0")\n'
    )


def input_weight_guard(moe, top_k: str) -> str:
    """Refuse configs choosing more than one expert per token where the block weights the
    experts' input: vLLM's fused MoE does that for top-1 routing only."""
    if not moe.weights_on_input:
        return ""
    message = f"hfrewrite: {moe.module_class} weights its experts' input: vLLM's fused MoE does so for one expert per token only"
    return f"if {top_k} != 1:\n    raise NotImplementedError({message!r})\n"


def stacked_sources(
    module: cst.Module, built: dict, moe, linear: dict[str, str] | None = None
) -> tuple[dict[str, str], str]:
    """Sizes and activation, as the source's router and stacked-experts classes assign them
    (``linear``: the sizes of a router that is the block's own Linear, ``block_linear_router``'s)."""
    name = moe.module_class
    for attr, cls in ((moe.router, moe.router_class), (moe.experts, moe.experts_class))[linear is not None :]:
        call = built.get(attr)
        if t.call_name(call) != cls or not call.args or not m.matches(call.args[0].value, m.Name("config")):
            raise HfrewriteError(f"{name}: {NAME}: self.{attr} is not {cls}(config)")
    router = linear if linear is not None else t.init_exprs(t.find_class(module, moe.router_class))
    experts = t.init_exprs(t.find_class(module, moe.experts_class))
    act = experts.get("act_fn", "")
    if moe.activation == "swigluoai":  # gpt_oss's clamped swiglu: vLLM's activation of that name
        act = 'ACT2FN["swigluoai"]'
    elif (
        act
        and isinstance(t.expr(act), cst.Name | cst.Attribute)
        and "config" not in t.root_names(t.expr(act))
    ):
        # one function whatever the config (LFM2-MoE's F.silu): the activation the replay proved
        act = f'ACT2FN["{moe.activation}"]'
    if not act.startswith("ACT2FN["):
        raise HfrewriteError(f"{name}: {NAME}: the experts' activation is not ACT2FN[...]")
    # transformers' names first, else the experts' attribute holding the size (by value)
    by_value = [experts.get(a) if a else None for a in moe.size_attrs or (None,) * 3]
    sizes = {
        "num_experts": router.get("num_experts") or experts.get("num_experts") or by_value[0],
        "top_k": router.get("top_k"),
        "hidden_size": router.get("hidden_dim") or experts.get("hidden_dim") or by_value[1],
        "intermediate_size": experts.get("intermediate_dim") or by_value[2],
    }
    missing = [k for k, v in sizes.items() if not v]
    if missing:
        raise HfrewriteError(f"{name}: {NAME}: the source does not name {', '.join(missing)}")
    return sizes, act[len("ACT2FN[") : -1]


def block_linear_router(module: cst.Module, built: dict, moe, block: dict[str, str]) -> dict[str, str] | None:
    """The sizes of a router that is the block's own ``nn.Linear(H, E)`` beside stacked
    experts (Jamba's; the block routes, and holds top_k in the attribute analysis found by
    value), as the router-class names ``stacked_sources`` reads: None for a router class."""
    if moe.router_class != "Linear" or not moe.top_k_attr:  # the traced router: nn.Linear (moe.py)
        return None
    found = router_sizes(module, built.get(moe.router), moe)
    if found is None or found[1]:  # the source builds another (a router class has __init__ expressions)
        return None
    (num_experts, hidden), _ = found
    resolved = {"num_experts": num_experts, "hidden_dim": hidden, "top_k": f"self.{moe.top_k_attr}"}
    return {k: t.resolved_self(v, block) for k, v in resolved.items()}


def built_with_block_config(experts: cst.BaseExpression, expert_cls: cst.ClassDef, moe) -> bool:
    """``nn.ModuleList([Expert(config) ...])`` with ``Expert.__init__(self, config)``: the
    experts' ``config`` is the block's."""
    calls = [n for n in t.walk(experts) if isinstance(n, cst.Call) and t.call_name(n) == moe.experts_class]
    params = t.positional_params(t.find_method(expert_cls, "__init__"), is_init=True)
    return (
        len(calls) == 1
        and bool(calls[0].args)
        and m.matches(calls[0].args[0].value, m.Name("config"))
        and params[:1] == ["config"]
    )


def bound_init_exprs(
    experts: cst.BaseExpression, expert_cls: cst.ClassDef, experts_class: str
) -> dict[str, str]:
    """``init_exprs`` of the expert class, each of its ``__init__`` parameters (``config``
    aside) replaced by what the block's one call binds to it, or by its default:
    ``DeepseekV3MLP(config, intermediate_size=config.moe_intermediate_size)`` makes
    ``self.intermediate_size = config.intermediate_size if intermediate_size is None else
    intermediate_size`` read the call's expression."""
    call = next(n for n in t.walk(experts) if isinstance(n, cst.Call) and t.call_name(n) == experts_class)
    init = t.find_method(expert_cls, "__init__")
    bound = {}
    for param in init.params.params[1:]:
        name = param.name.value
        at = t.bound_arg(call, init, True, name)
        if at is None or (at == -1 and param.default is None):
            return {}
        if name != "config":
            bound[name] = call.args[at].value if at != -1 else param.default

    return {attr: _bound(code, bound) for attr, code in t.init_exprs(expert_cls).items()}


def router_sizes(module: cst.Module, router: cst.BaseExpression | None, moe):
    """((E, H) expressions, the router class's ``__init__`` expressions) of ``nn.Linear(H, E)``
    (no class: ``{}``) or of ``Router(config)`` whose ``self.weight = nn.Parameter(
    torch.empty((E, H)))``; else None."""
    if builds(router, nn_call("Linear")):
        return (t.code(t.arg(router, 1, "out_features")), t.code(t.arg(router, 0, "in_features"))), {}
    if (
        t.call_name(router) != moe.router_class
        or not router.args
        or not m.matches(router.args[0].value, m.Name("config"))
    ):
        return None
    exprs = t.init_exprs(t.find_class(module, moe.router_class))
    empty = [
        n
        for n in t.walk(t.expr(exprs.get("weight", "None")))
        if isinstance(n, cst.Call) and t.call_name(n) in ("torch.empty", "torch.zeros", "torch.randn")
    ]
    if len(empty) != 1:
        return None
    dims = empty[0].args[0].value.elements if isinstance(empty[0].args[0].value, cst.Tuple) else empty[0].args
    dims = [d.value for d in dims]
    return ((t.code(dims[0]), t.code(dims[1])), exprs) if len(dims) == 2 else None
