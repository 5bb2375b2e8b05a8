"""An attention ``forward`` after fuse_qkv's q/k/v split, for ``passes/vllm_attention.py``:
its statements sorted (conditionals it carries, the source's tests on its q/k norms and on its
rope, config switches the trace left off, statements vLLM's attention makes redundant, anything
else refused), and the vLLM statements that replace them: q/k norms, rope, ``self.attn``."""

from __future__ import annotations

import ast
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from hfrewrite.analyze.branches import asks_own_attribute
from hfrewrite.analyze.norm_kinds import QkNormOrder
from hfrewrite.analyze.output_gates import OutputGate
from hfrewrite.analyze.plan import AttentionPlan
from hfrewrite.analyze.rope_styles import RopeLayers
from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.attention_body import (
    ALLOWED_CALLS,
    DROPOUT_CALLS,
    FACTORIES,
    attention_branches,
    cache_update,
    carried_conditional,
    config_switch,
    convention_locals,
    dead_for_config,
    flag_block,
    guards_rope,
    position_block,
    raises_only,
    reads_dropped_cache,
    state_names,
    taken_layout,
    unrecognised,
)
from hfrewrite.emit.kv_expansion import kv_expansion
from hfrewrite.emit.pass_api import PassContext
from hfrewrite.emit.position_scaled import position_scaled, same_line
from hfrewrite.emit.shared_matchers import TP_SIZE_LOCAL
from hfrewrite.emit.value_heads import after_attention, before_attention
from hfrewrite.errors import HfrewriteError

_PASS = "vllm_attention"  # the pass whose refusals these are
HEAD_DIM = "self.head_dim"  # where vLLM's attention reads the head size

_PER_HEAD_NORM = """\
{x}_by_head = {x}.view(*{x}.shape[:-1], {x}.shape[-1] // {head_dim}, {head_dim})
{x}_by_head = {normed}
{x} = {x}_by_head.view({x}.shape)
"""


_FIRST_HEADS = """\
# This rank's first q head and first kv head (kv heads are replicated over the
# ranks when there are fewer of them).
tp_rank = get_tensor_model_parallel_rank()
self.q_first_head = tp_rank * self.num_heads
self.k_first_head = tp_rank // max(1, {tp_size} // self.total_num_kv_heads) * self.num_kv_heads
"""

_ALL_HEADS_NORM = """\
# q/k norms over all heads, as in the source: under tensor parallelism each
# rank holds a slice of the heads: gather, normalise, take its slice back.
if self.tp_size > 1:
    q = tensor_model_parallel_all_gather(q.contiguous())
    k = tensor_model_parallel_all_gather(k.contiguous())
q = self.{q_norm}(q)
k = self.{k_norm}(k)
if self.tp_size > 1:
    q = q.chunk(self.tp_size, dim=-1)[self.tp_rank]
    k = k.chunk(self.tp_size, dim=-1)[self.tp_rank]
"""

_OUTPUT_NORM = """\
# The source's norm over every head's output, before the output projection: under
# tensor parallelism each rank holds a slice of the heads, gathered first (the
# projection then takes the whole input and keeps its rank's part).
attn_output = self.{norm}(tensor_model_parallel_all_gather(attn_output.contiguous()))
"""


@dataclass(frozen=True)
class AfterSplit:
    """What the source does after the split that the rewrite keeps, or keeps refused."""

    carried: tuple[cst.If, ...]  # config-switched conditionals, carried verbatim
    rope_test: cst.BaseExpression | None  # NoPE layers: the source's own condition on its rope
    norm_test: cst.BaseExpression | None  # the plan's q/k norms under the source's test
    untaken: tuple[cst.BaseExpression, ...]  # config branches the trace did not take
    q_scale: cst.BaseStatement | None = None  # the per-token q scale, on vLLM's q and positions


@dataclass(frozen=True)
class _Scope:
    """What the forward's statements after the split are judged against."""

    cls: cst.ClassDef
    body: list[cst.BaseStatement]  # the whole forward's
    allowed: set[str]
    states: dict[str, str]
    false_switches: set[str]  # the forward's switches the traced config left False (ast.dump)
    true_switches: set[str]  # ... and those it took
    params: set[str]
    caches: set[str]  # the Hugging Face inputs vLLM does not pass
    convention: set[str]  # and what the forward computes from them alone
    constants: frozenset[str]


def read_after_split(
    cls: cst.ClassDef,
    forward: cst.FunctionDef,
    split_at: int,
    checked: list[cst.BaseStatement],
    ctx: PassContext,
    constants: frozenset[str],
) -> AfterSplit:
    """Sort the ``checked`` statements of ``forward`` (after the split at ``split_at``):
    carried, kept as the tests of the norms or the rope, guarded, dropped, or refused;
    ``constants``: the names the module binds at its top level."""
    att = ctx.plan.attention
    scope = _scope(cls, forward, split_at, ctx, constants)
    carried: list[cst.If] = []
    rope_test: cst.BaseExpression | None = None
    norm_test: cst.BaseExpression | None = None
    untaken: list[cst.BaseExpression] = []  # config branches the trace did not take
    planned = {a for a in (att.q_norm, att.k_norm) if a}
    q_scale = None
    for statement in checked:
        if att.q_position_scale and same_line(att.q_position_scale[0], t.code(statement)):
            q_scale = position_scaled(statement, scope.params, scope.cls.name.value, att.q_position_scale[1:])
            continue
        test = config_switch(statement)
        if (conditional := carried_conditional(statement, scope.states)) is not None:
            carried.append(conditional)
        elif (
            test is not None
            and planned
            and t.self_attrs_used(statement.body) & planned
            and all(not unrecognised(s, scope.allowed) for s in statement.body.body)
        ):
            norm_test = test  # the traced config took it: the plan's norms, under its test
        elif test is not None and guards_rope(statement, scope.allowed, scope.states):
            rope_test = test  # NoPE layers: the source's own condition on its rope
        elif kv_expansion(statement, scope.allowed, scope.states):
            continue  # k and v expanded to every query head: vLLM's attention groups them itself
        elif taken_layout(
            statement, scope.true_switches, t.init_exprs(scope.cls), scope.allowed, scope.states
        ):
            # the head split the analysis accounted for: configs taking the other branch refused
            untaken.append(t.expr(f"not ({t.code(statement.test)})"))
        elif cache_update(statement, scope.params) or (
            att.attention_call.direct
            and (
                attention_branches(statement, scope.allowed)
                or reads_dropped_cache(statement, scope.caches, scope.allowed)
            )
        ):
            continue
        elif test is not None and not (t.self_attrs_used(statement.body) & planned) and att.q_norm is None:
            # A switch the traced config leaves off (cohere's use_qk_norm): what it
            # would do was never proven, so the file refuses configs that turn it on.
            untaken.append(test)
        else:
            _drop_or_refuse(statement, scope)
    if att.q_position_scale and q_scale is None:
        raise HfrewriteError(
            f"{scope.cls.name.value}: {_PASS}: the statement scaling q by position is not found"
        )
    return AfterSplit(tuple(carried), rope_test, norm_test, tuple(untaken), q_scale)


def _scope(
    cls: cst.ClassDef, forward: cst.FunctionDef, split_at: int, ctx: PassContext, constants: frozenset[str]
) -> _Scope:
    """What the statements of ``forward`` after the split at ``split_at`` are judged against."""
    body = list(forward.body.body)
    params = {p.name.value for p in (*forward.params.params, *forward.params.kwonly_params)}
    kept = forward.params.params[1].name.value if len(forward.params.params) > 1 else ""  # hidden states
    switches = {
        value: {
            ast.dump(ast.parse(test, mode="eval").body)
            for owner, test, taken in ctx.plan.forward_switches
            if owner == cls.name.value and taken is value
        }
        for value in (False, True)
    }
    return _Scope(
        cls=cls,
        body=body,
        allowed=_with_aliases(_allowed_calls(ctx.plan.attention), body),
        states=state_names(body[split_at + 1 :]),
        false_switches=switches[False],
        true_switches=switches[True],
        params=params,
        caches=params - {"self", kept},
        convention=convention_locals(forward),
        constants=constants,
    )


def _allowed_calls(att: AttentionPlan) -> set[str]:
    """The calls the forward may make after the split: the plan accounts for what they compute."""
    allowed = ALLOWED_CALLS | DROPOUT_CALLS | {a for a in (att.q_norm, att.k_norm, att.o.attr) if a}
    allowed |= FACTORIES if att.attention_call.direct else set()
    allowed |= set(att.replaced_calls)  # the analysis accounts for all they compute
    if (gate := att.output_gate) is not None:  # the proven gate: its projection and activation
        allowed |= {gate.attr, *gate.activation.calls, "mul", *(("float", "to") if gate.upcast else ())}
    if att.output_norm:  # the proven norm of the whole output: the tail calls it
        allowed |= {att.output_norm}
    if att.rotary_dim is not None and att.rotary_dim < att.head_dim:
        allowed |= {"cat"}  # partial rope: the proven rope region re-joins the passed lanes
    return allowed


def _with_aliases(allowed: set[str], body: list[cst.BaseStatement]) -> set[str]:
    """``allowed`` and the local names ``forward`` binds to one of them
    (TeleChat's ``apply_rotary_fn = apply_rotary_pos_emb_torch``)."""
    aliases = {
        s.body[0].targets[0].target.value
        for s in body
        if m.matches(
            s,
            m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())], value=m.Name())]),
        )
        and s.body[0].value.value in allowed
    }
    return allowed | aliases


def _drop_or_refuse(statement: cst.BaseStatement, scope: _Scope) -> None:
    """Nothing for a statement vLLM's attention makes redundant; refuses any other."""
    if raises_only(statement):
        return  # a shape check the traced run passed
    if position_block(
        statement, scope.params, scope.states, scope.allowed, scope.body[scope.body.index(statement) + 1 :]
    ):
        return  # the proven rope, under tests of the position inputs vLLM replaces
    if flag_block(statement, scope.caches | scope.convention, scope.constants, scope.states):
        return  # the traced calling convention's branch: proven by the analysis
    if dead_for_config(statement, scope.false_switches, t.init_exprs(scope.cls)):
        return  # never taken on this config: config_guards refuses those that take it
    if unrecognised(statement, scope.allowed):
        line = _first_line(statement)
        raise HfrewriteError(
            f"{scope.cls.name.value}: {_PASS}: forward does something vLLM's attention would not: {line}"
        )


def _first_line(statement: cst.BaseStatement, width: int = 80) -> str:
    """A statement's first line (a compound one's header), cut at a word within ``width``."""
    line = " ".join(t.code(statement).strip().splitlines()[0].split())
    return line if len(line) <= width else line[:width].rsplit(" ", 1)[0] + " ..."


def positionless(att: AttentionPlan) -> bool:
    """No rope and no ALiBi on q and k: positions learned, added to the embeddings."""
    return att.rope_layers is RopeLayers.NONE and att.alibi is None


def qk_norms(
    init: cst.FunctionDef, att: AttentionPlan, norm_test: cst.BaseExpression | None, name: str
) -> tuple[str, cst.FunctionDef]:
    """The forward's q/k norm statements, and ``__init__`` with what they read."""
    norms = ""
    where = att.qk_norm_order.value
    if att.qk_norm_over == "head":
        norms += f"# Per-head q/k norms, as in the source, {where} the rotary embedding.\n"
        for x, norm in (("q", att.q_norm), ("k", att.k_norm)):
            norms += _PER_HEAD_NORM.format(x=x, normed=f"self.{norm}({x}_by_head)", head_dim=HEAD_DIM)
    elif att.qk_norm_over == "each_head":
        norms += (
            f"# Per-head q/k norms, as in the source, {where} the rotary embedding. Their\n"
            "# weights differ per head and are built for every head: each rank normalises\n"
            "# its own heads in their places.\n"
        )
        for x, norm, total in (("q", att.q_norm, "total_num_heads"), ("k", att.k_norm, "total_num_kv_heads")):
            # weights of their own per head, built for all heads (analyze/head_norms.py)
            normed = f"norm_rank_heads(self.{norm}, {x}_by_head, self.{total}, self.{x}_first_head)"
            norms += _PER_HEAD_NORM.format(x=x, normed=normed, head_dim=HEAD_DIM)
        init = t.with_body(init, [*init.body.body, *t.stmts(_FIRST_HEADS.format(tp_size=_tp_size(init)))])
    elif att.qk_norm_over == "all_heads":
        norms += _ALL_HEADS_NORM.format(q_norm=att.q_norm, k_norm=att.k_norm)
        init = t.with_body(
            init,
            [
                *init.body.body,
                *t.stmts(
                    f"self.tp_size = {_tp_size(init)}\nself.tp_rank = get_tensor_model_parallel_rank()\n"
                ),
            ],
        )
    elif att.q_norm or att.k_norm:
        raise HfrewriteError(f"{name}: {_PASS}: q/k norms of unknown extent")
    if att.q_norm or att.k_norm:  # their comments describe the source's layout of q/k
        init = _without_trailing_comments(init, {att.q_norm, att.k_norm})
    if att.qk_norm_layers_some and norm_test is None:
        raise HfrewriteError(
            f"{name}: {_PASS}: some layers have no q/k norms, but the source's are unconditional"
        )
    if norm_test is not None:  # persimmon's `if self.qk_layernorm:`, Llama-4's `if hasattr(self, "qk_norm"):`
        norms = f"if {t.code(norm_test)}:\n" + "".join(f"    {line}\n" for line in norms.splitlines())
    return norms, init


def _tp_size(init: cst.FunctionDef) -> str:
    """The tensor-parallel size: fuse_qkv's prologue already binds it to a local."""
    has_local = any(m.matches(s, TP_SIZE_LOCAL) for s in init.body.body)
    return "tp_size" if has_local else "get_tensor_model_parallel_world_size()"


def _without_trailing_comments(init: cst.FunctionDef, attrs: set[str | None]) -> cst.FunctionDef:
    body = [
        s.with_changes(trailing_whitespace=cst.TrailingWhitespace())
        if isinstance(s, cst.SimpleStatementLine) and t.self_attr_assigned(s) in attrs
        else s
        for s in init.body.body
    ]
    return t.with_body(init, body)


_GATE = "# The source's output gate (proven by replay): {described}.\n"
_GATE_PROJECTION = "gate = self.{attr}(hidden_states)\n"


_PACKED = """\
# Each head's q and output gate side by side in the projection, as in the source.
q, gate = q.view(*q.shape[:-1], -1, 2 * {head_dim}).chunk(2, dim=-1)
q = q.reshape(*q.shape[:-2], -1)
gate = gate.reshape(*gate.shape[:-2], -1)
"""


def gated_output(gate: OutputGate) -> str:
    """The statements multiplying vLLM's attention output by the proven gate (a gate packed
    beside q is already taken apart from it: ``_PACKED``)."""
    code = _GATE.format(described=gate.describe())
    if not gate.packed:
        code += _GATE_PROJECTION.format(attr=gate.attr)
    if gate.upcast:  # as the source: the activation in float32, cast back
        act = gate.activation.expression.format(gate="gate.float()")
        code += f"gate = {act}.to(attn_output.dtype)\n"
    else:
        code += f"gate = {gate.activation.expression.format(gate='gate')}\n"
    if gate.per_head:
        return code + (
            "attn_output = (\n"
            f"    attn_output.view(*attn_output.shape[:-1], -1, {HEAD_DIM}) * gate.unsqueeze(-1)\n"
            ").view(attn_output.shape)\n"
        )
    return code + "attn_output = attn_output * gate\n"


def forward_tail(att: AttentionPlan, norms: str, source: AfterSplit, residual: str | None, name: str) -> str:
    """vLLM's forward after the kept projection: ``norms``, the rope, ``self.attn`` and the
    output projection; ``residual``: the parameter added to its output."""
    packed = att.output_gate is not None and att.output_gate.packed
    tail = _PACKED.format(head_dim=HEAD_DIM) if packed else ""
    tail += norms if att.qk_norm_order is QkNormOrder.BEFORE_ROPE else ""
    tail += "".join(t.code(c) for c in source.carried)
    if source.rope_test is not None:
        tail += f"if {t.code(source.rope_test)}:  # layers without rope (NoPE), as in the source\n    "
    elif att.rope_layers is RopeLayers.SOME and att.rope_base_field:  # built where the layer's base is not 0
        tail += "if self.rotary_emb is not None:  # layers without rope (NoPE)\n    "
    elif att.rope_layers is RopeLayers.SOME:
        raise HfrewriteError(
            f"{name}: {_PASS}: some layers have no rope, but the source's rope is unconditional"
        )
    tail += "q, k = self.rotary_emb(positions, q, k)\n" if not (att.alibi or positionless(att)) else ""
    if att.qk_norm_order is QkNormOrder.AFTER_ROPE:
        tail += norms
    if source.q_scale is not None:  # the last step on q in the source (analyze/position_scale.py)
        if not isinstance(source.q_scale, cst.If):
            tail += "# q scaled per token by the source's function of the positions, after the rope\n"
        tail += t.code(source.q_scale)
    return (
        tail
        + before_attention(att, HEAD_DIM)
        + "attn_output = self.attn(q, k, v)\n"
        + after_attention(att, HEAD_DIM)
        + (gated_output(att.output_gate) if att.output_gate else "")
        + (_OUTPUT_NORM.format(norm=att.output_norm) if att.output_norm else "")
        + f"attn_output = self.{att.o.attr}(attn_output)\n"
        + (f"return attn_output + {residual}\n" if att.adds_residual else "return attn_output\n")
    )


def untaken_guards(untaken: tuple[cst.BaseExpression, ...], cls: cst.ClassDef) -> tuple[str, str]:
    """Refusals of the config branches the trace did not take: those on config fields, to
    go first, and those on a computed attribute, to go after the sources."""
    exprs, first, later, name = t.init_exprs(cls), "", "", cls.name.value
    for test in untaken:
        if reads_own_attribute(t.code(test)):  # fixed once __init__ has built its parts
            raise HfrewriteError(
                f"{name}: vllm_attention: the forward's `{t.code(test)}` branch was never traced, and no "
                "test __init__ can make before it builds that attribute refuses the configs that take it"
            )
        try:
            expr, on_config = t.config_test(t.code(test), exprs), True
        except ValueError:
            expr, on_config = t.code(test), False
        guard = (
            f"if {expr}:\n"
            f'    raise NotImplementedError("hfrewrite: {name} was converted for configs where '
            f'`{expr.replace(chr(34), chr(39))}` is false")\n'
        )
        first, later = (first + guard, later) if on_config else (first, later + guard)
    return first, later


def reads_own_attribute(test: str) -> bool:
    """A test asking the module for its own attribute (``hasattr(self, ...)``): a guard at the
    top of ``__init__`` would decide nothing."""
    return any(asks_own_attribute(n) for n in ast.walk(ast.parse(test, mode="eval")))
