"""Replace a sparse MoE block's router and Python expert loop with vLLM's fused MoE.

Matches the plan's MoE block, built in the source as::

    self.gate = TopKRouter(config)      # weight [E, H]; softmax -> top-k -> (w /= w.sum)
    self.experts = Experts(config)      # gate_up_proj [E, 2I, H], down_proj [E, H, I]
    self.shared_expert = MLP(config, ...)                       # optional
    self.shared_expert_gate = nn.Linear(H, 1, bias=False)       # optional

Emits, in the idiom of vLLM's ``mixtral.py``::

    self.gate = GateLinear(H, E, prefix=...)
    self.experts = FusedMoEFactory(num_experts=E, top_k=K, hidden_size=H,
        intermediate_size=I, renormalize=R, activation=A, ckpt_names=(...), ...)
    ...
    router_logits, _ = self.gate(hidden_states)
    final_hidden_states = self.experts(hidden_states, router_logits)

``E``, ``K``, ``H``, ``I`` and ``A`` are the expressions the source's router and experts
classes assign (``config.num_experts``...); ``R`` is the condition guarding the source's
renormalisation (``config.norm_topk_prob``), ``True`` when it is unconditional. The shared
expert is kept (its MLP class is fused by ``fuse_gate_up``) and added to the routed output,
scaled by ``sigmoid`` of its gate, now a ``ReplicatedLinear``. The HF router and experts
classes become unreachable and are stripped.

Other expert layouts the replay proved: experts stacked transposed, gate and up interleaved,
with biases, behind vLLM's ``swigluoai`` (gpt_oss): ``has_bias=True,
activation="swigluoai"`` and a guard on its alpha and limit; experts as three flat
``[E * I, H]`` parameters (dbrx): sizes from the experts class's own expressions with its
``config`` bound to what the block passes (``config.ffn_config``), the block's routing
method dropped (hfrewrite/emit/expert_sources.py).

Preconditions: the plan found the MoE block (fx, checked by replaying it numerically);
the router and experts are built from the block's ``config``; every size the emitted call
needs is a plain ``self.x = <expr>`` in their ``__init__``; the source's renormalisation
agrees with the plan.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.expert_sources import (
    bound_init_exprs,
    built_with_block_config,
    flat_sources,
    layout,
    router_sizes,
    stacked_sources,
    swiglu_guard,
    taken_init_branches,
)
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites
from hfrewrite.emit.pure_expressions import computed_local
from hfrewrite.emit.templates_io import template_class
from hfrewrite.errors import HfrewriteError

NAME = "fuse_experts"


def _is_sum(node: cst.BaseExpression) -> bool:
    """``x.sum(...)``, possibly inside parentheses or further calls' receivers."""
    return bool(m.findall(node, m.Call(func=m.Attribute(attr=m.Name("sum")))))


def _renormalize(router: cst.ClassDef, attrs: dict[str, str], name: str) -> str | None:
    """The source's condition for `w /= w.sum(...)` ("True" if unconditional), or None.
    The divisor may be a name assigned from a sum (`denominator = w.sum(...) + eps`)."""
    forward = t.find_method(router, "forward")
    sums = {
        t.code(target.target)
        for a in m.findall(forward, m.Assign())
        for target in a.targets
        if isinstance(target.target, cst.Name) and _is_sum(a.value)
    }

    def _is_sum_or_name(node: cst.BaseExpression) -> bool:
        return _is_sum(node) or (isinstance(node, cst.Name) and node.value in sums)

    found = [condition for condition, _ in t.guarded_divisions(forward, _is_sum_or_name)]
    if len(found) > 1:
        raise HfrewriteError(f"{name}: {NAME}: the router renormalises more than once")
    if not found:
        return None
    condition = found[0]
    for attr, expr in attrs.items():  # `self.norm_topk_prob` -> `config.norm_topk_prob`
        condition = condition.replace(f"self.{attr}", expr)
    if "self." in condition:
        raise HfrewriteError(f"{name}: {NAME}: renormalisation depends on {condition}")
    return condition


def _gate(moe, sizes: dict[str, str]) -> list[cst.BaseStatement]:
    """The router as vLLM's GateLinear (float32 when the source routes in float32), and
    its score-correction bias as a float32 parameter named as in the checkpoint."""
    options = "    bias=True,\n" if moe.router_bias else ""
    if moe.router_fp32:
        options += "    out_dtype=torch.float32,\n    params_dtype=torch.float32,\n"
    src = (
        f"self.{moe.router} = GateLinear(\n    {sizes['hidden_size']},\n    {sizes['num_experts']},\n"
        f'{options}    prefix=f"{{prefix}}.{moe.router}",\n)\n'
    )
    if moe.correction_bias:  # where the checkpoint has it (ernie: in a child, shaped [1, E])
        *owners, _ = moe.correction_bias.split(".")
        for i in range(1, len(owners)):  # owners[0] is the router
            src += f"self.{'.'.join(owners[: i + 1])} = nn.Module()\n"
        shape = f"{'1, ' if moe.correction_bias_2d else ''}{sizes['num_experts']}"
        src += (
            f"self.{moe.correction_bias} = nn.Parameter(\n    torch.empty({shape}, dtype=torch.float32)\n)\n"
        )
    return t.stmts(src)


def _routing_kwargs(moe, where: dict[str, dict[str, str]], name: str) -> dict[str, str]:
    """FusedMoEFactory's routing options beyond softmax top-k. Each constant is the source's
    expression for the attribute analysis found holding its value (`self.num_group =
    config.n_group` -> `config.n_group`); ``where`` holds the router's and the block's
    ``__init__`` assignments."""
    if not moe.grouped:
        return {}
    exprs = {}
    for fact, path in moe.config_attrs:
        owner, attr = ("router", path.split(".", 1)[1]) if "." in path else ("block", path)
        expr = where[owner].get(attr)
        if expr is None or "self." in expr:
            raise HfrewriteError(
                f"{name}: {NAME}: the {fact} ({path}) is not set from the config in __init__"
            )
        exprs[fact] = expr
    kwargs = {
        "use_grouped_topk": "True",
        "num_expert_group": exprs.get("n_group", "1"),
        "topk_group": exprs.get("topk_group", "1"),
    }
    if moe.grouped_when:  # grouped on one branch of the router's switch, one group on the others
        try:
            when = t.config_test(moe.grouped_when, where["router"])
        except ValueError as e:
            raise HfrewriteError(
                f"{name}: {NAME}: the router switches on {e}, which no config field sets"
            ) from e
        for kwarg in ("num_expert_group", "topk_group"):
            kwargs[kwarg] = f"({kwargs[kwarg]} if {when} else 1)"
    if moe.scoring != "softmax":
        kwargs["scoring_func"] = f'"{moe.scoring}"'
    if moe.routed_scaling_factor != 1.0:
        kwargs["routed_scaling_factor"] = exprs["routed_scaling_factor"]
        kwargs["apply_routed_scale_to_output"] = "True"
    if moe.correction_bias:
        flat = "[0]" if moe.correction_bias_2d else ""  # a view: it sees the loaded values
        kwargs["e_score_correction_bias"] = f"self.{moe.correction_bias}{flat}"
    if moe.router_fp32:
        kwargs["router_logits_dtype"] = "torch.float32"
    return kwargs


def _builds_only(statement: cst.BaseStatement, attr: str) -> bool:
    """An ``if`` (no ``else``) whose body only assigns ``self.<attr>``."""
    return (
        isinstance(statement, cst.If)
        and statement.orelse is None
        and all(t.self_attr_assigned(s) == attr for s in statement.body.body)
    )


def rewrite_block(module: cst.Module, ctx: PassContext) -> tuple[cst.ClassDef, str]:
    """The rewritten block and the emitted renormalisation expression."""
    moe = ctx.plan.moe
    name = moe.module_class
    block = t.find_class(module, name)
    init, init_guards = taken_init_branches(t.find_method(block, "__init__"), moe)
    built = {t.self_attr_assigned(s): t.assigned_value(s) for s in init.body.body if t.self_attr_assigned(s)}
    if moe.expert_mlp is not None:  # experts one module each, the router the block's Linear or its own class
        sizes, act, renormalize, guards, router = _module_list_sources(module, block, built, moe)
        routing = _routing_kwargs(moe, {"router": router, "block": t.init_exprs(block)}, name)
    elif moe.flat_experts:  # experts as flat [E * I, H] parameters (dbrx)
        block_exprs = t.init_exprs(block)
        sizes, act, renormalize, guards = flat_sources(module, built, moe, block_exprs)
        routing = _routing_kwargs(moe, {"router": {}, "block": block_exprs}, name)
    elif moe.carried_router:  # the source's router runs as it is: its own code is the proof
        sizes, act = stacked_sources(module, built, moe)
        renormalize, guards, routing = (
            None,
            "",
            {"custom_routing_function": "self.route"},
        )
    else:
        sizes, act = stacked_sources(module, built, moe)
        router_cls = t.find_class(module, moe.router_class)
        router = t.init_exprs(router_cls)
        renormalize, guards = _source_renormalize(router_cls, router, moe, name)
        guards += swiglu_guard(module, moe)
        routing = _routing_kwargs(moe, {"router": router, "block": t.init_exprs(block)}, name)
    ckpt = moe.checkpoint_expert_names
    ckpt_arg = (
        ""
        if ckpt == ("gate_proj", "down_proj", "up_proj")
        else f"    ckpt_names={ckpt!r},\n".replace("'", '"')
    )

    gate = [] if moe.carried_router else _gate(moe, sizes)
    handoff = {} if moe.carried_router else {"gate": f"self.{moe.router}"}
    new_init: list[cst.BaseStatement] = []
    experts_at = None
    optional_shared = False
    for s in init.body.body:
        attr = t.self_attr_assigned(s)
        if attr is None and moe.shared_expert and _builds_only(s, moe.shared_expert):
            # `if config.n_shared > 0: self.shared = MLP(...)` after `self.shared = None`
            new_init.append(s.visit(_NotReducing(moe.shared_expert)))
            optional_shared = True
            continue
        if attr is None:
            if isinstance(s, cst.BaseCompoundStatement):
                raise HfrewriteError(
                    f"{name}: {NAME}: __init__ builds under a `{t.code(s).split()[0]}` "
                    "statement the rewrite would drop"
                )
            if computed_local(s):  # hy_v3's `shared_intermediate = ...` (drop_dead_locals drops unread ones)
                new_init.append(s)
                continue
            if t.code(s).strip() != "super().__init__()":
                continue
            new_init.append(s)
            new_init.extend(
                t.stmts(
                    "# Expert parallelism and its load balancer (EPLB), as in vLLM's qwen3_moe.py;\n"
                    "# the expert-parallel group exists where vLLM reads the config's expert count.\n"
                    "vllm_config = get_current_vllm_config()\n"
                    "parallel_config = vllm_config.parallel_config\n"
                    "self.ep_size = (\n"
                    "    get_ep_group().device_group.size() if vllm_config.model_config.get_num_experts() else 1\n"
                    ")\n"
                    f"self.n_routed_experts = {sizes['num_experts']}\n"
                    "self.n_logical_experts = self.n_routed_experts\n"
                    "self.n_redundant_experts = parallel_config.eplb_config.num_redundant_experts\n"
                    "self.n_physical_experts = self.n_logical_experts + self.n_redundant_experts\n"
                    "self.n_local_physical_experts = self.n_physical_experts // self.ep_size\n"
                )
            )
            continue
        elif attr == moe.router and moe.carried_router:
            new = s
        elif attr == moe.router:
            new = gate
        elif attr == moe.experts:
            experts_at = s  # built last: the runner takes the gate and the shared expert built before it
            continue
        elif attr == moe.shared_expert_gate:
            call = t.assigned_value(s)
            bias = t.arg(call, 2, "bias")
            new = t.stmt(
                f"self.{attr} = ReplicatedLinear(\n    {t.code(t.arg(call, 0, 'in_features'))},\n"
                f"    {t.code(t.arg(call, 1, 'out_features'))},\n    bias={t.code(bias) if bias else 'True'},\n"
                f'    quant_config=None,\n    prefix=f"{{prefix}}.{attr}",\n)\n'
            )
        elif attr == moe.shared_expert:
            new = s.visit(_NotReducing(moe.shared_expert))
        else:
            continue  # training-only knobs (jitter noise...) and router copies of config
        new = new if isinstance(new, list) else [new]
        new_init.append(new[0].with_changes(leading_lines=s.leading_lines))
        new_init.extend(new[1:])
    if moe.shared_expert:
        shared = f"self.{moe.shared_expert}"
        if moe.shared_expert_gate:
            gated = f"GatedSharedExpert({shared}, self.{moe.shared_expert_gate})"
            shared = f"{gated} if {shared} is not None else None" if optional_shared else gated
        handoff["shared_experts"] = shared
    new_init.append(
        t.stmt(
            f"self.{moe.experts} = FusedMoEFactory(\n"
            + "".join(f"    {k}={v},\n" for k, v in handoff.items())
            + "".join(f"    {k}={v},\n" for k, v in sizes.items())
            + f"    renormalize={renormalize or 'False'},\n"
            + "".join(f"    {k}={v},\n" for k, v in routing.items())
            + ("    has_bias=True,\n" if moe.experts_bias else "")
            + "    enable_eplb=parallel_config.enable_eplb,\n"
            "    num_redundant_experts=self.n_redundant_experts,\n"
            f"    activation={act},\n"
            "    quant_config=quant_config,\n"
            f'    prefix=f"{{prefix}}.{moe.experts}",\n'
            f"{ckpt_arg})\n"
        ).with_changes(leading_lines=experts_at.leading_lines)
    )

    steps = ["runs self.route" if moe.carried_router else "applies the gate"]
    steps += ["adds the shared expert"] if moe.shared_expert else []
    comment = f"# vLLM's MoE runner {' and '.join(steps)}"
    body = (
        "orig_shape = hidden_states.shape\nhidden_states = hidden_states.view(-1, orig_shape[-1])\n"
        f"{comment}.\n"
        f"final_hidden_states = self.{moe.experts}(hidden_states=hidden_states, router_logits=hidden_states)\n"
        "return final_hidden_states.view(orig_shape)\n"
    )
    forward = t.stmt("def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:\n    pass\n")
    forward = t.with_body(forward, t.stmts(body))
    new_init = t.guards_first(new_init, init_guards + guards)
    block = t.set_method(block, t.with_body(init, new_init))
    block = t.set_method(block, forward)
    block = t.without_unused_methods(block)  # the runner routes: dbrx's routing method, moe_infer go
    if moe.carried_router:
        w, ids = moe.carried_router
        block = t.set_method(
            block,
            t.stmt(
                "def route(\n    self, hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int, renormalize: bool\n"
                ") -> tuple[torch.Tensor, torch.Tensor]:\n"
                '    """The fused experts\' routing: the source\'s router, run as it is."""\n'
                f"    routing = self.{moe.router}(hidden_states)\n"
                f"    if routing[{ids}].shape[-1] != topk:\n"
                f'        raise ValueError(f"{moe.router_class} chose {{routing[{ids}].shape[-1]}} experts per token, "\n'
                f'                         f"the fused experts take {{topk}}")\n'
                f"    return routing[{w}], routing[{ids}]\n"
            ),
        )
    return block, renormalize or "False"


def _module_list_sources(
    module: cst.Module, block: cst.ClassDef, built: dict, moe
) -> tuple[dict, str, str, str, dict]:
    """Sizes, activation, renormalisation, router guards and the router's ``__init__``
    expressions of a block whose experts are ``nn.ModuleList([Expert(config, ...) ...])`` and
    whose router is its own ``nn.Linear(H, E)`` or a router class holding an ``[E, H]``
    weight (DeepSeek's Hub ``MoEGate(config)``), from the expressions the source builds them with."""
    name, mlp = moe.module_class, moe.expert_mlp
    router = built.get(moe.router)
    experts = built.get(moe.experts)
    makes_expert = experts is not None and any(
        isinstance(n, cst.Call) and t.call_name(n) == moe.experts_class for n in t.walk(experts)
    )
    found_sizes = router_sizes(module, router, moe)
    if found_sizes is None or t.call_name(experts) != "nn.ModuleList" or not makes_expert:
        raise HfrewriteError(
            f"{name}: {NAME}: not self.{moe.router} = nn.Linear(H, E) (or {moe.router_class}(config) "
            f"holding an [E, H] weight) and self.{moe.experts} = nn.ModuleList([{moe.experts_class}(...) ...])"
        )
    expert_cls = t.find_class(module, moe.experts_class)
    expert_init = {
        t.self_attr_assigned(s): t.assigned_value(s) for s in t.find_method(expert_cls, "__init__").body.body
    }
    gate = expert_init.get(mlp.gate.attr)
    if t.call_name(gate) != "nn.Linear":
        raise HfrewriteError(f"{name}: {NAME}: the experts' {mlp.gate.attr} is not nn.Linear(H, I)")
    block_exprs = t.init_exprs(block)
    # the sizes as the block and its experts compute them (`self.ffn_dim = config...`),
    # the experts built with the block's own `config` (and keywords of the call, bound)
    expert_exprs = {}
    if built_with_block_config(experts, expert_cls, moe):
        expert_exprs = bound_init_exprs(experts, expert_cls, moe.experts_class)
    (num_experts, hidden), router_exprs = found_sizes
    sizes = {
        "num_experts": t.resolved_self(num_experts, router_exprs or block_exprs),
        "top_k": block_exprs.get(moe.top_k_attr, ""),
        "hidden_size": t.resolved_self(hidden, router_exprs or block_exprs),
        "intermediate_size": t.resolved_self(t.code(t.arg(gate, 1, "out_features")), expert_exprs),
    }
    for size, expression in sizes.items():
        if "self." in expression or not expression:
            raise HfrewriteError(
                f"{name}: {NAME}: {size} ({expression or '?'}) is not computed from the config"
            )
    act = f'"{mlp.activation}"'
    if mlp.act_attr:
        act = code if (code := t.code(expert_init.get(mlp.act_attr))).startswith("ACT2FN[") else ""
        if not act:
            raise HfrewriteError(f"{name}: {NAME}: the experts' activation is not ACT2FN[...]")
        act = act[len("ACT2FN[") : -1]
    if router_exprs:
        renormalize, guards = _source_renormalize(
            t.find_class(module, moe.router_class), router_exprs, moe, name
        )
        return sizes, act, renormalize, guards, router_exprs
    renormalize, _ = _source_renormalize(block, block_exprs, moe, name)
    return sizes, act, renormalize, "", {}


class _NotReducing(cst.CSTTransformer):
    """`self.<shared> = MLP(...)` gains `reduce_results=False`: the runner all-reduces the
    shared expert's partial output together with the routed experts' (row_parallel gives
    the MLP class that parameter)."""

    def __init__(self, attr: str) -> None:
        self.attr = attr

    def leave_Assign(self, original, updated):
        if t.code(updated.targets[0].target) == f"self.{self.attr}" and isinstance(updated.value, cst.Call):
            arg = cst.Arg(
                value=cst.Name("False"),
                keyword=cst.Name("reduce_results"),
                equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")),
            )
            return updated.with_changes(value=updated.value.with_changes(args=[*updated.value.args, arg]))
        return updated


def _insert_before(module: cst.Module, name: str, new: cst.ClassDef) -> cst.Module:
    body = list(module.body)
    at = next(i for i, n in enumerate(body) if isinstance(n, cst.ClassDef) and n.name.value == name)
    body.insert(at, new.with_changes(leading_lines=body[at].leading_lines))
    return module.with_changes(body=body)


def _source_renormalize(
    router_cls: cst.ClassDef, router: dict[str, str], moe, name: str
) -> tuple[str | None, str]:
    """The source's renormalisation condition, checked against the trace, and the guards
    that refuse configs flipping the router's other branches."""
    renormalize = _renormalize(router_cls, router, name)
    router_forward = t.find_method(router_cls, "forward")
    if renormalize is None and moe.renormalize and not m.findall(router_forward, m.If() | m.IfExp()):
        renormalize = "True"  # a softmax over the top-k logits, unconditional: the replay proved it
    if (renormalize is None and moe.renormalize) or (renormalize == "True" and not moe.renormalize):
        raise HfrewriteError(f"{name}: {NAME}: the source's renormalisation disagrees with the trace")
    try:
        guards = t.branch_guards(moe.router_branches, router, name, "router", skip=renormalize)
        guards += _switch_guard(moe, router, name)
    except ValueError as e:
        raise HfrewriteError(f"{name}: {NAME}: the router branches on {e}, which no config field sets") from e
    return renormalize, guards


def _switch_guard(moe, router: dict[str, str], name: str) -> str:
    """Refuse the strings of the router's switch no trace proved."""
    if moe.router_switch is None:
        return ""
    attr, values = moe.router_switch
    expr = t.config_test(attr, router)
    proven = "(" + ", ".join(f'"{v}"' for v in values) + ")"
    return (
        f"if {expr} not in {proven}:\n"
        f'    raise NotImplementedError("hfrewrite: {name} was converted for {expr} in {proven.replace(chr(34), chr(39))}: '
        'its router takes another branch here")\n'
    )


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    moe = ctx.plan.moe
    if moe is None:
        return PassResult(module=module)
    block, renormalize = rewrite_block(module, ctx)
    gate, down, up = moe.checkpoint_expert_names
    rows = [
        FusionRow(
            moe.module_class,
            f"router {moe.router}: {moe.describe_routing()} (emitted renormalize="
            f"{renormalize}) -> "
            + (
                "FusedMoEFactory custom_routing_function=self.route"
                if moe.carried_router
                else "GateLinear + FusedMoEFactory routing"
            ),
        ),
        FusionRow(
            moe.module_class,
            (
                f"{moe.experts}: flat [E * I, H] experts (gate {moe.flat_experts[0]}, up {moe.flat_experts[1]}, "
                f"down {moe.flat_experts[2]} transposed; proven by replay), {moe.activation} -> FusedMoEFactory "
                "(load_weights hands them over one expert at a time)"
                if moe.flat_experts
                else f"{moe.experts}: stacked {layout(moe)} experts, {moe.activation} -> FusedMoEFactory "
                f"(checkpoint experts.N.{{{gate},{up},{down}}})"
            ),
        ),
    ]
    rows += [
        FusionRow(moe.module_class, f"checkpoint rename {old!r} -> {new!r}")
        for old, new in moe.checkpoint_renames
    ]
    imports = ["FusedMoEFactory", "get_current_vllm_config", "get_ep_group"]
    if not moe.carried_router:
        imports.append("GateLinear")
    if moe.shared_expert_gate:
        rows.append(
            FusionRow(
                moe.module_class,
                f"{moe.shared_expert} + sigmoid({moe.shared_expert_gate}) kept",
            )
        )
        imports.append("ReplicatedLinear")
    sites = Sites()
    module = sites.replace_class(module, moe.module_class, block)
    if moe.shared_expert_gate:
        module = _insert_before(
            module,
            moe.module_class,
            template_class("moe.py", "GatedSharedExpert", {}, {}),
        )
    return PassResult(
        module=module,
        imports=tuple(imports),
        fused=tuple(rows),
        matches=sites.count,
    )
