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
method dropped (hfrewrite/emit/expert_sources.py); experts run on every token's input
scaled by its routing weight (Llama-4): ``apply_router_weight_on_input=True`` and a guard
refusing configs that choose more than one expert per token, which vLLM does not weight so.

Preconditions: the plan found the MoE block (fx, checked by replaying it numerically);
the router and experts are built from the block's ``config``; every size the emitted call
needs is a plain ``self.x = <expr>`` in their ``__init__``; the source's renormalisation
agrees with the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.expert_sources import (
    block_linear_router,
    bound_init_exprs,
    built_with_block_config,
    flat_sources,
    input_weight_guard,
    layout,
    router_sizes,
    stacked_sources,
    swiglu_guard,
)
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites
from hfrewrite.emit.pure_expressions import computed_local
from hfrewrite.emit.router_sources import routing_kwargs, source_renormalize
from hfrewrite.emit.shared_matchers import ACT2FN_ENTRY, SUPER_INIT_BARE, builds, nn_call, self_attr
from hfrewrite.emit.taken_init import one_guard_per_condition, taken_init_branches
from hfrewrite.emit.templates_io import insert_before, template_class
from hfrewrite.errors import HfrewriteError

NAME = "fuse_experts"


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


def _builds_only(statement: cst.BaseStatement, attr: str) -> bool:
    """An ``if`` (no ``else``) whose body only assigns ``self.<attr>``."""
    return (
        isinstance(statement, cst.If)
        and statement.orelse is None
        and all(t.self_attr_assigned(s) == attr for s in statement.body.body)
    )


@dataclass(frozen=True)
class _Sources:
    """What the emitted ``FusedMoEFactory`` call takes from the source's classes."""

    sizes: dict[str, str]  # FusedMoEFactory's size keywords -> the source's expressions
    act: str
    renormalize: str | None  # the source's condition; None when it does not renormalise
    guards: str  # statements refusing the configs the trace did not prove
    routing: dict[str, str]  # FusedMoEFactory's routing keywords beyond softmax top-k


def _sources(module: cst.Module, block: cst.ClassDef, built: dict, moe) -> _Sources:
    """The sizes, activation, renormalisation, guards and routing options, read from the
    classes that build the block's router and experts."""
    name = moe.module_class
    if moe.expert_mlp is not None:  # experts one module each, the router the block's Linear or its own class
        sizes, act, renormalize, guards, router = _module_list_sources(module, block, built, moe)
        routing = routing_kwargs(moe, {"router": router, "block": t.init_exprs(block)}, name)
    elif moe.flat_experts:  # experts as flat [E * I, H] parameters (dbrx)
        block_exprs = t.init_exprs(block)
        sizes, act, renormalize, guards = flat_sources(module, built, moe, block_exprs)
        routing = routing_kwargs(moe, {"router": {}, "block": block_exprs}, name)
    elif moe.carried_router:  # the source's router runs as it is: its own code is the proof
        linear = block_linear_router(module, built, moe, t.init_exprs(block))
        sizes, act = stacked_sources(module, built, moe, linear)
        renormalize, guards, routing = (
            None,
            "",
            {"custom_routing_function": "self.route"},
        )
    else:
        linear = block_linear_router(module, built, moe, t.init_exprs(block))
        sizes, act = stacked_sources(module, built, moe, linear)
        # the block's own nn.Linear: the block routes (Jamba's), its code holds the renormalisation
        router_cls = block if linear is not None else t.find_class(module, moe.router_class)
        router = t.init_exprs(router_cls)
        renormalize, guards = source_renormalize(router_cls, router, moe, name)
        guards += swiglu_guard(module, moe) + input_weight_guard(moe, sizes["top_k"])
        routing = routing_kwargs(moe, {"router": router, "block": t.init_exprs(block)}, name)
        if moe.weights_on_input:  # Llama-4: each chosen expert runs on its weight times the input
            routing["apply_router_weight_on_input"] = "True"
    return _Sources(sizes, act, renormalize, guards, routing)


@dataclass(frozen=True)
class _Init:
    """The runner's ``__init__`` statements but the experts', and where those were built."""

    body: list[cst.BaseStatement]
    experts_at: cst.BaseStatement | None  # the source's `self.<experts> = ...`
    optional_shared: bool  # the shared expert is built under an `if` (None otherwise)


def _rebuilt_init(init: cst.FunctionDef, moe, sizes: dict[str, str]) -> _Init:
    """``__init__``'s statements with the gate as GateLinear, the shared expert and its gate
    kept for the runner, and the source's other attributes dropped."""
    gate = [] if moe.carried_router else _gate(moe, sizes)
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
            new_init.extend(_kept_unassigning(s, moe.module_class, sizes))
            continue
        elif attr == moe.router and moe.carried_router:
            new = s
        elif attr == moe.router:
            new = gate
        elif attr == moe.experts:
            experts_at = s  # built last: the runner takes the gate and the shared expert built before it
            continue
        elif attr == moe.shared_expert_gate:
            new = _replicated_gate(s, attr)
        elif attr == moe.shared_expert:
            new = s.visit(_NotReducing(moe.shared_expert))
        elif attr == moe.output_module:
            new = s  # run on the runner's output (A.X-K1's post_mlp_layernorm)
        else:
            continue  # training-only knobs (jitter noise...) and router copies of config
        new = new if isinstance(new, list) else [new]
        new_init.append(new[0].with_changes(leading_lines=s.leading_lines))
        new_init.extend(new[1:])
    return _Init(new_init, experts_at, optional_shared)


def _kept_unassigning(s: cst.BaseStatement, name: str, sizes: dict[str, str]) -> list[cst.BaseStatement]:
    """What the runner's ``__init__`` keeps of a statement assigning no attribute: computed
    locals, and ``super().__init__()`` followed by the expert-parallel setup."""
    if isinstance(s, cst.BaseCompoundStatement):
        raise HfrewriteError(
            f"{name}: {NAME}: __init__ builds under a `{t.code(s).split()[0]}` "
            "statement the rewrite would drop"
        )
    if computed_local(s):  # hy_v3's `shared_intermediate = ...` (drop_dead_locals drops unread ones)
        return [s]
    if not m.matches(s, SUPER_INIT_BARE):
        return []
    return [
        s,
        *t.stmts(
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
        ),
    ]


def _replicated_gate(s: cst.BaseStatement, attr: str) -> cst.BaseStatement:
    """The shared expert's ``nn.Linear`` gate as vLLM's ``ReplicatedLinear``."""
    call = t.assigned_value(s)
    bias = t.arg(call, 2, "bias")
    return t.stmt(
        f"self.{attr} = ReplicatedLinear(\n    {t.code(t.arg(call, 0, 'in_features'))},\n"
        f"    {t.code(t.arg(call, 1, 'out_features'))},\n    bias={t.code(bias) if bias else 'True'},\n"
        f'    quant_config=None,\n    prefix=f"{{prefix}}.{attr}",\n)\n'
    )


def _handoff(moe, optional_shared: bool) -> dict[str, str]:
    """What the runner takes from the block: the gate it applies, the shared expert it adds."""
    handoff = {} if moe.carried_router else {"gate": f"self.{moe.router}"}
    if moe.shared_expert:
        shared = f"self.{moe.shared_expert}"
        if moe.shared_expert_gate:
            gated = f"GatedSharedExpert({shared}, self.{moe.shared_expert_gate})"
            shared = f"{gated} if {shared} is not None else None" if optional_shared else gated
        handoff["shared_experts"] = shared
    return handoff


def _fused_experts(moe, sources: _Sources, handoff: dict[str, str]) -> cst.BaseStatement:
    """``self.<experts> = FusedMoEFactory(...)``, naming the checkpoint's expert weights
    where they are not vLLM's default names."""
    ckpt = moe.checkpoint_expert_names
    ckpt_arg = (
        ""
        if ckpt == ("gate_proj", "down_proj", "up_proj")
        else f"    ckpt_names={ckpt!r},\n".replace("'", '"')
    )
    return t.stmt(
        f"self.{moe.experts} = FusedMoEFactory(\n"
        + "".join(f"    {k}={v},\n" for k, v in handoff.items())
        + "".join(f"    {k}={v},\n" for k, v in sources.sizes.items())
        + f"    renormalize={sources.renormalize or 'False'},\n"
        + "".join(f"    {k}={v},\n" for k, v in sources.routing.items())
        + ("    has_bias=True,\n" if moe.experts_bias else "")
        + "    enable_eplb=parallel_config.enable_eplb,\n"
        "    num_redundant_experts=self.n_redundant_experts,\n"
        f"    activation={sources.act},\n"
        "    quant_config=quant_config,\n"
        f'    prefix=f"{{prefix}}.{moe.experts}",\n'
        f"{ckpt_arg})\n"
    )


def _forward(moe) -> cst.FunctionDef:
    """The block's forward: vLLM's MoE runner on the flattened tokens."""
    steps = ["runs self.route" if moe.carried_router else "applies the gate"]
    steps += ["adds the shared expert"] if moe.shared_expert else []
    comment = f"# vLLM's MoE runner {' and '.join(steps)}"
    output = "final_hidden_states.view(orig_shape)"
    body = (
        "orig_shape = hidden_states.shape\nhidden_states = hidden_states.view(-1, orig_shape[-1])\n"
        f"{comment}.\n"
        f"final_hidden_states = self.{moe.experts}(hidden_states=hidden_states, router_logits=hidden_states)\n"
        f"return {f'self.{moe.output_module}({output})' if moe.output_module else output}\n"
    )
    forward = t.stmt("def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:\n    pass\n")
    return t.with_body(forward, t.stmts(body))


def _route_method(moe) -> cst.FunctionDef:
    """``route``, the fused experts' custom routing function: the source's router as it is."""
    w, ids = moe.carried_router
    return t.stmt(
        "def route(\n    self, hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int, renormalize: bool\n"
        ") -> tuple[torch.Tensor, torch.Tensor]:\n"
        '    """The fused experts\' routing: the source\'s router, run as it is."""\n'
        f"    routing = self.{moe.router}(hidden_states)\n"
        f"    if routing[{ids}].shape[-1] != topk:\n"
        f'        raise ValueError(f"{moe.router_class} chose {{routing[{ids}].shape[-1]}} experts per token, "\n'
        f'                         f"the fused experts take {{topk}}")\n'
        f"    return routing[{w}], routing[{ids}]\n"
    )


def rewrite_block(module: cst.Module, ctx: PassContext) -> tuple[cst.ClassDef, str]:
    """The rewritten block and the emitted renormalisation expression."""
    moe = ctx.plan.moe
    name = moe.module_class
    block = t.find_class(module, name)
    init, init_guards = taken_init_branches(
        t.find_method(block, "__init__"),
        moe.init_switches,
        moe.module_class,
        t.init_exprs(block),
        keep=lambda s: bool(moe.shared_expert) and _builds_only(s, moe.shared_expert),  # both ways
    )
    built = {t.self_attr_assigned(s): t.assigned_value(s) for s in init.body.body if t.self_attr_assigned(s)}
    sources = _sources(module, block, built, moe)
    rebuilt = _rebuilt_init(init, moe, sources.sizes)
    experts = _fused_experts(moe, sources, _handoff(moe, rebuilt.optional_shared))
    new_init = [*rebuilt.body, experts.with_changes(leading_lines=rebuilt.experts_at.leading_lines)]
    new_init = t.guards_first(new_init, one_guard_per_condition(init_guards + sources.guards))
    block = t.set_method(block, t.with_body(init, new_init))
    block = t.set_method(block, _forward(moe))
    block = t.without_unused_methods(block)  # the runner routes: dbrx's routing method, moe_infer go
    if moe.carried_router:
        block = t.set_method(block, _route_method(moe))
    return block, sources.renormalize or "False"


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
    if found_sizes is None or not builds(experts, nn_call("ModuleList")) or not makes_expert:
        raise HfrewriteError(
            f"{name}: {NAME}: not self.{moe.router} = nn.Linear(H, E) (or {moe.router_class}(config) "
            f"holding an [E, H] weight) and self.{moe.experts} = nn.ModuleList([{moe.experts_class}(...) ...])"
        )
    expert_cls = t.find_class(module, moe.experts_class)
    expert_init = {
        t.self_attr_assigned(s): t.assigned_value(s) for s in t.find_method(expert_cls, "__init__").body.body
    }
    gate = expert_init.get(mlp.gate.attr)
    if not builds(gate, nn_call("Linear")):
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
        entry = expert_init.get(mlp.act_attr)
        if entry is None or not m.matches(entry, ACT2FN_ENTRY):
            raise HfrewriteError(f"{name}: {NAME}: the experts' activation is not ACT2FN[...]")
        act = t.code(entry)[len("ACT2FN[") : -1]
    if router_exprs:
        renormalize, guards = source_renormalize(
            t.find_class(module, moe.router_class), router_exprs, moe, name
        )
        return sizes, act, renormalize, guards, router_exprs
    renormalize, _ = source_renormalize(block, block_exprs, moe, name)
    return sizes, act, renormalize, "", {}


class _NotReducing(cst.CSTTransformer):
    """`self.<shared> = MLP(...)` gains `reduce_results=False`: the runner all-reduces the
    shared expert's partial output together with the routed experts' (row_parallel gives
    the MLP class that parameter)."""

    def __init__(self, attr: str) -> None:
        self.attr = attr

    def leave_Assign(self, original, updated):
        if m.matches(updated.targets[0].target, self_attr(self.attr)) and isinstance(updated.value, cst.Call):
            arg = cst.Arg(
                value=cst.Name("False"),
                keyword=cst.Name("reduce_results"),
                equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")),
            )
            return updated.with_changes(value=updated.value.with_changes(args=[*updated.value.args, arg]))
        return updated


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
        module = insert_before(
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
