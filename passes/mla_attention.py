"""Replace multi-head latent attention (deepseek_v2/v3) with vLLM's ``MLAAttention``.

Matches the attention class of an ``MlaPlan`` (analyze/mla.py proved the roles and replayed
vLLM's MLA against the module). Emits the layout of vLLM's ``deepseek_v2.py``: the low-rank
query and latent kv projections that read the same input fused into one replicated GEMM
(``fused_qkv_a_proj``; without a low-rank query, ``kv_a`` is a ``ReplicatedLinear`` and
``q`` a ``ColumnParallelLinear``), ``kv_b`` column-parallel (heads split across ranks),
``o`` row-parallel, ``get_rope`` in the proven style, and ``MLAAttention``, which owns the
compressed KV cache ``[kv_lora_rank + rope]`` per token and absorbs ``kv_b`` at decode.

``__init__`` keeps the source's statements (sizes, norms, the scaling expression) except
the projections it replaces; attributes the traced config left None (the other branch of
a conditional projection) keep their source assignment and the file refuses configs that
set them. ``forward`` is vLLM's: the source's runs through the HF cache. The rope is
applied to contiguous ``[tokens, heads * rope]`` copies: vLLM 0.32's CPU rotary kernel
reads a strided or 3-D view wrongly (its own deepseek_v2 computes wrong prefill on CPU).

Preconditions: the attention call passes ``scaling=`` (carried as the softmax scale);
``self.mla_attn`` / ``self.rotary_emb`` / ``self.fused_qkv_a_proj`` are free names.
"""

from __future__ import annotations

from typing import NamedTuple

import libcst as cst
import libcst.matchers as m

from hfrewrite.analyze.mla_cache import MlaCache
from hfrewrite.analyze.plan import MlaPlan
from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.attention_body import AttentionCallKwargs
from hfrewrite.emit.mla_per_head import per_head_attention, per_head_call
from hfrewrite.emit.mla_rope import LEGACY_ROPE, ROPE_CALL, rope_guard, rope_parameters, rope_params
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites
from hfrewrite.errors import HfrewriteError

NAME = "mla_attention"

_LINEAR = """\
self.{attr} = {kind}(
    {size_in},
    {size_out},
    bias=False,{extra}
    quant_config=quant_config,
    prefix=f"{{prefix}}.{attr}",
)
"""


def _query_linears(plan: MlaPlan, d, low_rank: bool) -> str:
    """The latent kv projection and the query's: fused into one replicated GEMM beside a
    low-rank query, else ``kv_a`` replicated and one column-parallel ``q``."""
    if low_rank:
        return _LINEAR.format(
            attr="fused_qkv_a_proj",
            kind="MergedColumnParallelLinear",
            size_in=f"self.{d('hidden_size')}",
            size_out=f"[self.{d('q_lora_rank')}, self.{d('kv_lora_rank')} + self.{d('qk_rope_head_dim')}]",
            extra="\n    disable_tp=True,",
        ) + _LINEAR.format(
            attr=plan.q_b,
            kind="ColumnParallelLinear",
            size_in=f"self.{d('q_lora_rank')}",
            size_out=f"self.{d('num_heads')} * self.{d('qk_head_dim')}",
            extra="",
        )
    return _LINEAR.format(
        attr=plan.kv_a,
        kind="ReplicatedLinear",
        size_in=f"self.{d('hidden_size')}",
        size_out=f"self.{d('kv_lora_rank')} + self.{d('qk_rope_head_dim')}",
        extra="",
    ) + _LINEAR.format(
        attr=plan.q_other or plan.q_b,
        kind="ColumnParallelLinear",
        size_in=f"self.{d('hidden_size')}",
        size_out=f"self.{d('num_heads')} * self.{d('qk_head_dim')}",
        extra="",
    )


def _branches(test: str, low_rank_when: bool, low_rank: str, single: str) -> str:
    """``if test: ... else: ...`` with the low-rank query's code where ``test`` is
    ``low_rank_when``."""
    first, second = (low_rank, single) if low_rank_when else (single, low_rank)
    return f"if {test}:\n{_indent(first)}else:\n{_indent(second)}"


def _indent(code: str) -> str:
    return "".join(f"    {line}\n" if line else "\n" for line in code.splitlines())


def _linears(plan: MlaPlan, d, switch: str | None) -> str:
    """The vLLM projections, as vLLM's deepseek_v2.py lays them out; ``switch``: the
    ``__init__`` form of the test choosing the query when both are proven."""
    out = (
        "tp_size = get_tensor_model_parallel_world_size()\n"
        f"assert self.{d('num_heads')} % tp_size == 0\n"
        f"self.num_local_heads = self.{d('num_heads')} // tp_size\n"
    )
    if switch is not None:
        out += _branches(
            switch,
            plan.q_switch[1],
            _query_linears(plan, d, low_rank=True),
            _query_linears(plan, d, low_rank=False),
        )
    else:
        out += _query_linears(plan, d, low_rank=plan.q_a is not None)
    out += _LINEAR.format(
        attr=plan.kv_b,
        kind="ColumnParallelLinear",
        size_in=f"self.{d('kv_lora_rank')}",
        size_out=f"self.{d('num_heads')} * (self.{d('qk_nope_head_dim')} + self.{d('v_head_dim')})",
        extra="",
    )
    out += _LINEAR.format(
        attr=plan.o,
        kind="RowParallelLinear",
        size_in=f"self.{d('num_heads')} * self.{d('v_head_dim')}",
        size_out=f"self.{d('hidden_size')}",
        extra="",
    )
    return out


def _attention(plan: MlaPlan, d, scaling: str, name: str) -> str:
    """The rope and vLLM's attention layer for the proven KV cache."""
    return (
        "self.rotary_emb = get_rope(\n"
        f"    self.{d('qk_rope_head_dim')},\n"
        "    max_position=config.max_position_embeddings,\n"
        + (
            f"    rope_parameters=(\n        {rope_parameters(plan)}\n    ),\n"
            if len(plan.rope_kinds) > 1
            else f"    rope_parameters={rope_parameters(plan)},\n"
        )
        + f"    is_neox_style={plan.rope_style.is_neox},\n"
        ")\n"
        + (
            "# vLLM's deepseek_yarn rope computes on [tokens, heads, rope]; the default one on\n"
            "# contiguous [tokens, heads * rope] (its CPU kernel misreads 3-D views).\n"
            f'self.rope_per_head = {rope_params(plan)}.get("rope_type", "default") == "yarn"\n'
            if len(plan.rope_kinds) > 1
            else ""
        )
        + (
            per_head_attention(d, scaling, name)
            if plan.kv_cache is MlaCache.PER_HEAD
            else _latent_attention(plan, d, scaling)
        )
    )


def _latent_attention(plan: MlaPlan, d, scaling: str) -> str:
    q_lora = f"self.{d('q_lora_rank')}" if plan.q_a is not None else "None"  # None on the single-q branch
    return (
        "self.mla_attn = MLAAttention(\n"
        "    num_heads=self.num_local_heads,\n"
        f"    scale={scaling},\n"
        f"    qk_nope_head_dim=self.{d('qk_nope_head_dim')},\n"
        f"    qk_rope_head_dim=self.{d('qk_rope_head_dim')},\n"
        f"    v_head_dim=self.{d('v_head_dim')},\n"
        f"    q_lora_rank={q_lora},\n"
        f"    kv_lora_rank=self.{d('kv_lora_rank')},\n"
        f"    kv_b_proj=self.{plan.kv_b},\n"
        "    cache_config=cache_config,\n"
        "    quant_config=quant_config,\n"
        '    prefix=f"{prefix}.attn",\n'
        ")\n"
    )


def _project(plan: MlaPlan, d, low_rank: bool) -> str:
    rope, kv_lora = f"self.{d('qk_rope_head_dim')}", f"self.{d('kv_lora_rank')}"
    if low_rank:
        return (
            "q_c, kv_lora = self.fused_qkv_a_proj(hidden_states)[0].split(\n"
            f"    [self.{d('q_lora_rank')}, {kv_lora} + {rope}], dim=-1\n"
            ")\n"
            f"q = self.{plan.q_b}(self.{plan.q_a_norm}(q_c))[0]\n"
        )
    return f"kv_lora = self.{plan.kv_a}(hidden_states)[0]\nq = self.{plan.q_other or plan.q_b}(hidden_states)[0]\n"


def _rope_call(plan: MlaPlan, rope: str) -> str:
    if len(plan.rope_kinds) > 1:
        return _branches(
            "self.rope_per_head",
            True,
            ROPE_CALL["deepseek_yarn"],
            ROPE_CALL["default"].format(rope=rope),
        )
    return ROPE_CALL.get(plan.rope_kind, ROPE_CALL["default"]).format(rope=rope)


def _forward(plan: MlaPlan, d) -> str:
    rope, kv_lora = f"self.{d('qk_rope_head_dim')}", f"self.{d('kv_lora_rank')}"
    if plan.q_switch is not None:
        low, single = _project(plan, d, True), _project(plan, d, False)
        project = _branches(plan.q_switch[0], plan.q_switch[1], low, single)
    else:
        project = _project(plan, d, plan.q_a is not None)
    return (
        "def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:\n"
        + "".join(
            f"    {line}\n"
            for line in (
                project + f"kv_c, k_pe = kv_lora.split([{kv_lora}, {rope}], dim=-1)\n"
                f"kv_c_normed = self.{plan.kv_a_norm}(kv_c)\n"
                f"q = q.view(-1, self.num_local_heads, self.{d('qk_head_dim')})\n"
                f"q_nope, q_pe = q.split([self.{d('qk_nope_head_dim')}, {rope}], dim=-1)\n"
                + _rope_call(plan, rope)
                + _attention_call(plan, d)
            ).splitlines()
        )
    )


def _attention_call(plan: MlaPlan, d) -> str:
    if plan.kv_cache is MlaCache.PER_HEAD:
        return per_head_call(d, plan.kv_b, plan.o)
    return (
        "attn_output = self.mla_attn(\n"
        "    q,\n"
        "    kv_c_normed,\n"
        "    k_pe,\n"
        f"    output_shape=(hidden_states.shape[0], self.num_local_heads * self.{d('v_head_dim')}),\n"
        ")\n"
        f"return self.{plan.o}(attn_output)[0]\n"
    )


class _KeptInit(NamedTuple):
    """The source's ``__init__`` without the projections the rewrite builds."""

    body: list[cst.BaseStatement]
    at: int  # where the first replaced projection stood
    guarded: list[str]  # attributes the traced config left None


def _scaling(forward: cst.FunctionDef, plan: MlaPlan, name: str) -> str:
    """The source's softmax scale expression, carried to ``MLAAttention``."""
    finder = AttentionCallKwargs()
    forward.visit(finder)
    if plan.scale_attr:  # attention by hand: its scale's attribute, proven by value
        finder.kwargs = {"scaling": t.expr(f"self.{plan.scale_attr}")}
    if finder.kwargs is None or "scaling" not in finder.kwargs:
        raise HfrewriteError(f"{name}: {NAME}: no attention_interface(..., scaling=...) call in forward")
    return t.code(finder.kwargs["scaling"])


def _kept_init(init: cst.FunctionDef, cls: cst.ClassDef, plan: MlaPlan, name: str) -> _KeptInit:
    """``__init__``'s statements less the replaced projections and the source's rope builder."""
    replaced = {a for a in (plan.q_a, plan.q_b, plan.q_other, plan.kv_a, plan.kv_b, plan.o) if a}
    body, at, guarded = [], None, []
    made = {"mla_attn", "attn", "rotary_emb", "fused_qkv_a_proj", "num_local_heads"}
    for s in init.body.body:
        attr = t.self_attr_assigned(s)
        if attr in made:
            raise HfrewriteError(f"{name}: {NAME}: self.{attr} already exists")
        if attr in replaced:
            at = len(body) if at is None else at
            continue
        if isinstance(s, cst.If) and _assigned_in(s) & replaced:  # `if self.q_lora_rank is None:` ...
            at = len(body) if at is None else at
            if (s := _without_assignments(s, replaced)) is None:
                continue
        if _only_rebuilds(s, cls, made):  # `self._init_rope()`: the source's rope, replaced
            continue
        if attr in plan.none_attrs:
            guarded.append(attr)
        body.append(s)
    if at is None:
        raise HfrewriteError(f"{name}: {NAME}: the projections are not assigned in __init__")
    return _KeptInit(body, at, guarded)


def _branch_guards(cls: cst.ClassDef, plan: MlaPlan, name: str) -> tuple[str, str | None]:
    """The guards refusing configs that take a branch the trace did not, and the
    ``__init__`` form of the test choosing the query where both are proven."""
    try:
        switches = t.branch_guards(plan.config_branches, t.init_exprs(cls), name, "forward")
        switches += t.branch_guards(plan.init_branches, t.init_exprs(cls), name, "__init__")
        query_switch = plan.q_switch and t.config_test(plan.q_switch[0], t.init_exprs(cls))
    except ValueError as e:
        raise HfrewriteError(
            f"{name}: {NAME}: the forward branches on {e}, which no config field sets"
        ) from e
    return switches, query_switch


def _none_guards(name: str, guarded: list[str]) -> str:
    """Attributes the traced config left None: refused once the source has assigned them."""
    return "".join(
        f"if self.{attr} is not None:\n"
        f'    raise NotImplementedError("hfrewrite: {name} was converted for configs where self.{attr} is None")\n'
        for attr in guarded
    )


def rewrite(cls: cst.ClassDef, plan: MlaPlan) -> cst.ClassDef:
    name = cls.name.value
    init, forward = t.find_method(cls, "__init__"), t.find_method(cls, "forward")
    scaling = _scaling(forward, plan, name)
    d = plan.dim
    kept = _kept_init(init, cls, plan, name)
    switches, query_switch = _branch_guards(cls, plan, name)
    guards = _none_guards(name, kept.guarded)
    body = kept.body
    layout = (
        "deepseek_v2.py lays it out" if plan.kv_cache is MlaCache.LATENT else "minicpm3.py runs it per head"
    )
    body[kept.at : kept.at] = t.stmts(
        f"# Multi-head latent attention as vLLM's {layout}.\n" + _linears(plan, d, query_switch)
    )
    attention, rope_guards = _attention(plan, d, scaling, name), rope_guard(plan, name)
    if "tp_size" in t.plain_names(init):
        raise HfrewriteError(f"{name}: {NAME}: __init__ already uses the name tp_size")
    if plan.rope_source == "rope_scaling":  # a 4.x config: its parameters gathered first
        if "rope_parameters" in t.plain_names(init):
            raise HfrewriteError(f"{name}: {NAME}: __init__ already uses the name rope_parameters")
        rope_guards = LEGACY_ROPE + rope_guards
    body += t.stmts(guards + attention)
    body = t.guards_first(body, switches + rope_guards)
    cls = t.set_method(cls, t.with_body(init, body))
    cls = t.set_method(
        cls,
        forward.with_changes(
            **{
                k: getattr(t.stmt(_forward(plan, d)), k)
                for k in ("params", "returns", "body", "whitespace_before_params")
            }
        ),
    )
    return t.without_unused_methods(cls)  # helpers of the source's forward (expand_kv) go with it


def _assigned_in(node: cst.CSTNode) -> set[str]:
    """The ``self.<attr>`` assigned anywhere in ``node``."""
    return {
        a for s in t.walk(node) if isinstance(s, cst.SimpleStatementLine) and (a := t.self_attr_assigned(s))
    }


def _without_assignments(statement: cst.If, attrs: set[str]) -> cst.BaseStatement | None:
    """An ``if``/``else`` of ``__init__`` without its assignments of ``attrs`` (the projections
    the rewrite builds itself): a branch left empty goes, its test negated when the other
    branch stays; None when nothing stays."""

    def kept(block) -> list[cst.BaseStatement]:
        return [s for s in block.body if t.self_attr_assigned(s) not in attrs] if block else []

    body, orelse = kept(statement.body), kept(statement.orelse.body if statement.orelse else None)
    if any(isinstance(s, cst.BaseCompoundStatement) for s in body + orelse) or isinstance(
        statement.orelse, cst.If
    ):
        raise HfrewriteError(f"{NAME}: the projections are built under nested branches")
    if not body and not orelse:
        return None
    if not body:
        negated = t.expr(f"not ({t.code(statement.test)})")
        return statement.with_changes(
            test=negated, body=statement.body.with_changes(body=orelse), orelse=None
        )
    orelse_block = (
        statement.orelse.with_changes(body=statement.orelse.body.with_changes(body=orelse))
        if orelse
        else None
    )
    return statement.with_changes(body=statement.body.with_changes(body=body), orelse=orelse_block)


def _only_rebuilds(statement: cst.BaseStatement, cls: cst.ClassDef, attrs: set[str]) -> bool:
    """``self.<method>()`` where the method's only effect on the module is assigning
    attributes the rewrite assigns itself (the source's ``_init_rope`` building its rope)."""
    if not m.matches(
        statement,
        m.SimpleStatementLine(body=[m.Expr(m.Call(func=m.Attribute(value=m.Name("self")), args=[]))]),
    ):
        return False
    method = t.find_method(cls, statement.body[0].value.func.attr.value)
    if method is None:
        return False
    assigned = _assigned_in(method)
    calls_self = m.findall(method, m.Call(func=m.Attribute(value=m.Name("self"))))
    return bool(assigned) and assigned <= attrs and not calls_self


def _cache_row(plan: MlaPlan) -> str:
    if plan.kv_cache is MlaCache.PER_HEAD:
        return (
            f"latent attention -> vllm Attention over k and v expanded per head (vLLM 0.32 keeps a "
            f"latent cache only for the types it lists; head {plan.qk_nope_head_dim}+{plan.qk_rope_head_dim}, "
            f"v {plan.v_head_dim} padded; proven by replay)"
        )
    return (
        f"latent attention -> vllm MLAAttention (compressed KV cache "
        f"{plan.kv_lora_rank}+{plan.qk_rope_head_dim}; proven by replay)"
    )


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    plan = ctx.plan.attention
    if not isinstance(plan, MlaPlan):
        return PassResult(module=module)
    cls = rewrite(t.find_class(module, plan.module_class), plan)
    fused = "fused_qkv_a_proj ([q_a; kv_a], replicated)" if plan.q_a else f"{plan.kv_a} replicated"
    if plan.q_other:
        fused += f" (without a low-rank query: {plan.kv_a} replicated, {plan.q_other} column-parallel)"
    style = plan.rope_style.label
    rows = (
        FusionRow(
            plan.module_class,
            _cache_row(plan),
        ),
        FusionRow(
            plan.module_class,
            f"{fused}, {plan.q_b}/{plan.kv_b} -> ColumnParallelLinear, {plan.o} -> RowParallelLinear",
        ),
        FusionRow(
            plan.module_class,
            f"get_rope ({' or '.join(plan.rope_kinds or (plan.rope_kind,))}, {style} style, "
            f"rotary dim {plan.qk_rope_head_dim})",
        ),
    )
    kinds = ["ColumnParallelLinear", "RowParallelLinear"]
    kinds += ["MergedColumnParallelLinear"] if plan.q_a else []
    kinds += ["ReplicatedLinear"] if plan.q_a is None or plan.q_other else []
    sites = Sites()
    module = sites.replace_class(module, plan.module_class, cls)
    return PassResult(
        module=module,
        imports=(
            plan.kv_cache.vllm_class,
            "get_rope",
            "get_tensor_model_parallel_world_size",
            *kinds,
        ),
        fused=rows,
        matches=sites.count,
    )
