"""Replace the Hugging Face attention call with vLLM ``Attention`` and ``get_rope``.

Matches the attention class after ``fuse_qkv``: ``forward`` starts from
``qkv, _ = self.qkv_proj(x)`` / ``q, k, v = qkv.split(...)``, then reshapes to
``[batch, heads, seq, head_dim]``, optionally applies per-head q/k norms, applies rotary
embeddings from ``position_embeddings``, updates the HF cache and calls
``ALL_ATTENTION_FUNCTIONS``. vLLM owns the cache, the masks and the layout, so the body
after the split becomes vLLM's (as in its ``qwen3.py`` for q/k norms). Emits::

    q, k = self.rotary_emb(positions, q, k)
    attn_output = self.attn(q, k, v)
    attn_output = self.o_proj(attn_output)

``__init__`` gains ``self.rotary_emb = get_rope(...)`` and ``self.attn = Attention(...)``;
the ``scaling=`` and ``sliding_window=`` expressions of the source's attention call are
carried over verbatim, so config-dependent sliding windows survive.

``is_neox_style`` is the style the analysis proved by numeric replay (analyze/rope.py), never
read off a helper's name; a partial rotary dim reaches ``get_rope`` through
``config.rope_parameters["partial_rotary_factor"]``, which the replay checked.

Attention sinks the call passes (``s_aux=self.sinks``, one logit per head) go to
``Attention(sinks=...)``, the parameter cut to the rank's heads; statements between the
fused projection and its split (dbrx's ``clip_qkv`` clamp, which the analysis proved
elementwise) are kept.

Preconditions: the plan found rope on q and k; the attention call passes ``scaling=``; ``forward`` starts with the
``fuse_qkv`` split; ``self.attn`` and ``self.rotary_emb`` are free names; after the split the
source only reshapes q/k/v, applies the plan's q/k norms, calls the functions the analysis proved
compute nothing the plan does not account for (``apply_rotary_pos_emb``, a GQA ``repeat_kv``, a
helper calling torch's SDPA proven causal: ``AttentionPlan.replaced_calls``), the cache
update, the attention call and the output projection -- a conditional rope (NoPE layers,
smollm3) or any other op is refused rather than dropped.
"""

from __future__ import annotations

import ast

import libcst as cst
import libcst.matchers as m

from hfrewrite.analyze.plan import MlaPlan
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
    unrecognised,
)
from hfrewrite.emit.given_residual import projection_at, residual_param
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites
from hfrewrite.emit.position_code import ALIBI_INIT, ALIBI_SLOPES, rope_init, rotary_builders
from hfrewrite.emit.templates_io import template_class
from hfrewrite.errors import HfrewriteError

NAME = "vllm_attention"

_PER_HEAD_NORM = """\
{x}_by_head = {x}.view(*{x}.shape[:-1], {x}.shape[-1] // {head_dim}, {head_dim})
{x}_by_head = self.{norm}({x}_by_head)
{x} = {x}_by_head.view({x}.shape)
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


# `q, k, v = qkv.split(...)`, as fuse_qkv writes it
_QKV_SPLIT = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[
                m.AssignTarget(
                    m.Tuple(
                        [
                            m.Element(m.Name("q")),
                            m.Element(m.Name("k")),
                            m.Element(m.Name("v")),
                        ]
                    )
                )
            ],
            value=m.Call(func=m.Attribute(value=m.Name("qkv"), attr=m.Name("split"))),
        )
    ]
)


class _FindAttentionCall(cst.CSTVisitor):
    """The call `attention_interface(self, q, k, v, mask, **kw)`: its keyword arguments."""

    def __init__(self) -> None:
        self.kwargs: dict[str, cst.BaseExpression] | None = None

    def visit_Call(self, node: cst.Call) -> None:
        if t.dotted(node.func) == "attention_interface":
            self.kwargs = {a.keyword.value: a.value for a in node.args if a.keyword is not None}


def _without_trailing_comments(init: cst.FunctionDef, attrs: set[str | None]) -> cst.FunctionDef:
    body = [
        s.with_changes(trailing_whitespace=cst.TrailingWhitespace())
        if isinstance(s, cst.SimpleStatementLine) and t.self_attr_assigned(s) in attrs
        else s
        for s in init.body.body
    ]
    return t.with_body(init, body)


def rewrite_attention(
    cls: cst.ClassDef, ctx: PassContext, constants: frozenset[str] = frozenset()
) -> tuple[cst.ClassDef, list[str]]:
    """The rewritten class, and notes for ``--explain`` on what was carried or guarded;
    ``constants``: the names the module binds at its top level."""
    att = ctx.plan.attention
    name = cls.name.value
    init, forward = t.find_method(cls, "__init__"), t.find_method(cls, "forward")
    finder = _FindAttentionCall()
    forward.visit(finder)
    if att.direct_sdpa:  # proven causal, at torch's default scale; its call is among replaced_calls
        finder.kwargs = {"scaling": t.expr("self.head_dim**-0.5")}
    if finder.kwargs is None or "scaling" not in finder.kwargs:
        raise HfrewriteError(f"{name}: {NAME}: no attention_interface(..., scaling=...) call in forward")
    positionless = not att.rope and att.alibi is None
    if positionless and ctx.plan.position_embedding is None:
        raise HfrewriteError(f"{name}: {NAME}: no rotary embedding on q and k (NoPE)")
    if "rotary_emb" in att.replaced_calls:  # the source's rotary module: the proven rope
        init = t.with_body(init, [s for s in init.body.body if t.self_attr_assigned(s) != "rotary_emb"])
    assigned = {t.self_attr_assigned(s) for s in init.body.body}
    if {"attn", "rotary_emb"} & assigned:
        raise HfrewriteError(f"{name}: {NAME}: self.attn / self.rotary_emb already exist")
    body = list(forward.body.body)
    split_at = next((i for i, s in enumerate(body) if m.matches(s, _QKV_SPLIT)), None)
    if split_at is None:
        raise HfrewriteError(f"{name}: {NAME}: forward has no q/k/v split (run fuse_qkv first)")

    allowed = ALLOWED_CALLS | DROPOUT_CALLS | {a for a in (att.q_norm, att.k_norm, att.o.attr) if a}
    allowed |= FACTORIES if att.direct_sdpa else set()
    allowed |= set(att.replaced_calls)  # the analysis accounts for all they compute
    if att.rotary_dim is not None and att.rotary_dim < att.head_dim:
        allowed |= {"cat"}  # partial rope: the proven rope region re-joins the passed lanes
    states = state_names(body[split_at + 1 :])
    false_switches = {
        ast.dump(ast.parse(test, mode="eval").body)
        for owner, test, value in ctx.plan.forward_switches
        if owner == name and value is False
    }
    carried: list[cst.If] = []
    params = {p.name.value for p in (*forward.params.params, *forward.params.kwonly_params)}
    kept = forward.params.params[1].name.value if len(forward.params.params) > 1 else ""  # hidden states
    caches = params - {"self", kept}  # the Hugging Face inputs vLLM does not pass
    convention = convention_locals(forward)  # and what the forward computes from them alone
    rope_test: cst.BaseExpression | None = None
    norm_test: cst.BaseExpression | None = None
    untaken: list[cst.BaseExpression] = []  # config branches the trace did not take
    planned = {a for a in (att.q_norm, att.k_norm) if a}
    checked = body[split_at + 1 :]
    if att.adds_residual:  # what follows the projection adds the given tensor: proven
        residual = residual_param(forward, att.o.attr, name)
        checked = body[split_at + 1 : projection_at(body, att.o.attr) + 1]
    for statement in checked:
        test = config_switch(statement)
        if (conditional := carried_conditional(statement, states)) is not None:
            carried.append(conditional)
        elif (
            test is not None
            and planned
            and t.self_attrs_used(statement.body) & planned
            and all(not unrecognised(s, allowed) for s in statement.body.body)
        ):
            norm_test = test  # the traced config took it: the plan's norms, under its test
        elif test is not None and guards_rope(statement, allowed, states):
            rope_test = test  # NoPE layers: the source's own condition on its rope
        elif cache_update(statement, params) or (
            att.direct_sdpa
            and (attention_branches(statement, allowed) or reads_dropped_cache(statement, caches, allowed))
        ):
            continue
        elif test is not None and not (t.self_attrs_used(statement.body) & planned) and att.q_norm is None:
            # A switch the traced config leaves off (cohere's use_qk_norm): what it
            # would do was never proven, so the file refuses configs that turn it on.
            untaken.append(test)
        elif raises_only(statement):
            continue  # a shape check the traced run passed
        elif position_block(statement, params, states, allowed, body[body.index(statement) + 1 :]):
            continue  # the proven rope, under tests of the position inputs vLLM replaces
        elif flag_block(statement, (params - {"self", kept}) | convention, constants, states):
            continue  # the traced calling convention's branch: proven by the analysis
        elif dead_for_config(statement, false_switches, t.init_exprs(cls)):
            continue  # never taken on this config: config_guards refuses those that take it
        elif unrecognised(statement, allowed):
            line = " ".join(t.code(statement).split())[:80]
            raise HfrewriteError(f"{name}: {NAME}: forward does something vLLM's attention would not: {line}")

    scaling = t.code(finder.kwargs["scaling"])
    window = (
        f"    per_layer_sliding_window={t.code(finder.kwargs['sliding_window'])},\n"
        if "sliding_window" in finder.kwargs
        else ""
    )
    if "softcap" in finder.kwargs:
        window += f"    logits_soft_cap={t.code(finder.kwargs['softcap'])},\n"
    if att.sinks:
        window += f"    sinks=self.{att.sinks},\n"
        init = _sinks_per_rank(init, att.sinks, name)
    head_dim = "self.head_dim"
    rope_parameters = "config.rope_parameters"
    if att.rope_fields:  # a transformers 4.x config: the fields the replay read, by name
        entries = ", ".join(  # a field of the config, or the source's constant base
            f'"{key}": {field if field[0].isdigit() else "config." + field}' for key, field in att.rope_fields
        )
        rope_parameters = '{"rope_type": "default", ' + entries + "}"
    if att.rotary_dim_field:  # GPT-J: the rotated width in lanes, as a share of the head
        rope_parameters = (
            f'{{**{rope_parameters}, "partial_rotary_factor": config.{att.rotary_dim_field} / {head_dim}}}'
        )
    if att.rope_per_layer_type:  # {layer type: parameters}: this layer's entry
        if "layer_idx" not in {p.name.value for p in init.params.params}:
            raise HfrewriteError(
                f"{name}: {NAME}: rope parameters per layer type, but __init__ has no layer_idx"
            )
        rope_parameters = "config.rope_parameters[config.layer_types[layer_idx]]"
    # untaken switches on config fields go first; one on a computed attribute after the sources
    exprs, first, later = t.init_exprs(cls), "", ""
    for test in untaken:
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
    init = t.with_body(
        init,
        [
            *t.guards_first(list(init.body.body), first),
            *t.stmts(
                later
                + (
                    ALIBI_INIT.format(factor=att.alibi)
                    if att.alibi
                    else ""
                    if positionless  # learned positions, added to the embeddings
                    else rope_init(att, head_dim, rope_parameters)
                )
                + "self.attn = Attention(\n"
                "    self.num_heads,\n"
                f"    {head_dim},\n"
                f"    {scaling},\n"
                "    num_kv_heads=self.num_kv_heads,\n"
                "    cache_config=cache_config,\n"
                "    quant_config=quant_config,\n"
                f"{window}"
                + ("    alibi_slopes=alibi_slopes,\n" if att.alibi else "")
                + '    prefix=f"{prefix}.attn",\n'
                ")\n"
            ),
        ],
    )

    norms = ""
    where = "after" if att.qk_norm_after_rope else "before"
    if att.qk_norm_over == "head":
        norms += f"# Per-head q/k norms, as in the source, {where} the rotary embedding.\n"
        norms += _PER_HEAD_NORM.format(x="q", norm=att.q_norm, head_dim=head_dim)
        norms += _PER_HEAD_NORM.format(x="k", norm=att.k_norm, head_dim=head_dim)
    elif att.qk_norm_over == "all_heads":
        norms += _ALL_HEADS_NORM.format(q_norm=att.q_norm, k_norm=att.k_norm)
        # fuse_qkv's prologue already binds the tensor-parallel size to a local.
        has_local = any(
            t.code(s).strip() == "tp_size = get_tensor_model_parallel_world_size()" for s in init.body.body
        )
        tp_size = "tp_size" if has_local else "get_tensor_model_parallel_world_size()"
        init = t.with_body(
            init,
            [
                *init.body.body,
                *t.stmts(f"self.tp_size = {tp_size}\nself.tp_rank = get_tensor_model_parallel_rank()\n"),
            ],
        )
    elif att.q_norm or att.k_norm:
        raise HfrewriteError(f"{name}: {NAME}: q/k norms of unknown extent")
    if att.q_norm or att.k_norm:  # their comments describe the source's layout of q/k
        init = _without_trailing_comments(init, {att.q_norm, att.k_norm})
    if norm_test is not None:  # persimmon's `if self.qk_layernorm:`
        norms = f"if {t.code(norm_test)}:\n" + "".join(f"    {line}\n" for line in norms.splitlines())
    tail = "" if att.qk_norm_after_rope else norms
    tail += "".join(t.code(c) for c in carried)
    if rope_test is not None:
        tail += f"if {t.code(rope_test)}:  # layers without rope (NoPE), as in the source\n    "
    elif att.nope_layers:
        raise HfrewriteError(
            f"{name}: {NAME}: some layers have no rope, but the source's rope is unconditional"
        )
    tail += "q, k = self.rotary_emb(positions, q, k)\n" if not (att.alibi or positionless) else ""
    if att.qk_norm_after_rope:
        tail += norms
    tail += f"attn_output = self.attn(q, k, v)\nattn_output = self.{att.o.attr}(attn_output)\n" + (
        f"return attn_output + {residual}\n" if att.adds_residual else "return attn_output\n"
    )
    kept = _input_as_hidden_states(forward, body[_projection_at(body, split_at, name) : split_at + 1], name)
    given = f", {residual}: torch.Tensor" if att.adds_residual else ""
    params = t.stmt(
        f"def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor{given}) -> torch.Tensor:\n"
        "    pass\n"
    )
    forward = forward.with_changes(
        params=params.params,
        returns=params.returns,
        whitespace_before_params=params.whitespace_before_params,
    )
    forward = t.with_body(forward, [*kept, *t.stmts(tail)])
    notes = [f"rope only where the source's `{t.code(rope_test)}` holds (NoPE layers)"] if rope_test else []
    notes += [
        f"config branch `if {t.code(test)}:` never traced: the file refuses configs that take it"
        for test in untaken
    ]
    notes += [f"`if {' '.join(t.code(c.test).split())}:` carried from the source" for c in carried]
    notes += [f"q/k norms under the source's `if {t.code(norm_test)}:`"] if norm_test is not None else []
    cls = t.set_method(t.set_method(cls, init), forward)
    if "rotary_emb" in att.replaced_calls:  # `self._init_rope()`, which only built the source's
        builders = rotary_builders(cls)
        init = t.find_method(cls, "__init__")
        kept = [s for s in init.body.body if t.code(s).strip() not in builders]
        cls = t.set_method(cls, t.with_body(init, kept))
    return cls, notes


# What fuse_qkv carries between the projection and the split: the elementwise ops on the
# whole projection the analysis proved (dbrx's clip_qkv clamp) and the constants they read.
_BEFORE_SPLIT_CALLS = {"clamp", "clip"}


def _projection_at(body: list[cst.BaseStatement], split_at: int, cls: str) -> int:
    """Where ``qkv, _ = self.<proj>(...)`` is, the statements up to the split carried."""
    at = split_at - 1
    while at >= 0 and not (
        isinstance(body[at], cst.SimpleStatementLine)
        and t.code(body[at]).lstrip().startswith("qkv, _ = self.")
    ):
        switched = (
            config_switch(body[at]) is not None and body[at].orelse is None
        )  # mpt's `if self.clip_qkv:`
        stmts = body[at].body.body if switched else [body[at]]
        if any(unrecognised(s, _BEFORE_SPLIT_CALLS) for s in stmts):
            line = " ".join(t.code(body[at]).split())[:80]
            raise HfrewriteError(f"{cls}: {NAME}: between the q/k/v projection and its split: {line}")
        at -= 1
    if at < 0:
        raise HfrewriteError(f"{cls}: {NAME}: no `qkv, _ = self.<projection>(...)` before the split")
    return at


def _sinks_per_rank(init: cst.FunctionDef, attr: str, cls: str) -> cst.FunctionDef:
    """``self.<sinks> = nn.Parameter(...)`` -> one sink logit per head of this rank, loaded
    as this rank's slice of the checkpoint's per-head tensor (as vLLM's gpt_oss.py does)."""
    body = list(init.body.body)
    at = [i for i, s in enumerate(body) if t.self_attr_assigned(s) == attr]
    if len(at) != 1 or t.call_name(t.assigned_value(body[at[0]])) != "nn.Parameter":
        raise HfrewriteError(f"{cls}: {NAME}: self.{attr} (the attention sinks) is not one nn.Parameter")
    new = t.stmts(
        "# Attention sinks: one logit per head, this rank's heads.\n"
        f"self.{attr} = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)\n"
        f'set_weight_attrs(self.{attr}, {{"weight_loader": sharded_weight_loader(0)}})\n'
    )
    new[0] = new[0].with_changes(leading_lines=body[at[0]].leading_lines)
    body[at[0] : at[0] + 1] = new
    return t.with_body(init, body)


def _input_as_hidden_states(
    forward: cst.FunctionDef, kept: list[cst.BaseStatement], cls: str
) -> list[cst.BaseStatement]:
    """The kept projection statements reading the input under vLLM's parameter name,
    ``hidden_states`` (custom code calls it ``x``...)."""
    params = [p.name.value for p in forward.params.params if p.name.value != "self"]
    used = t.names_used(cst.Module(kept))
    if not params or params[0] == "hidden_states" or params[0] not in used:
        return kept
    if "hidden_states" in used:
        raise HfrewriteError(f"{cls}: {NAME}: the input {params[0]} and a local hidden_states")
    fn = t.with_body(forward, kept)
    return list(t.rename_locals(fn, {params[0]: "hidden_states"}).body.body)


def _with_class_before(module: cst.Module, cls: cst.ClassDef, before: str) -> cst.Module:
    body = list(module.body)
    at = next(
        i for i, node in enumerate(body) if isinstance(node, cst.ClassDef) and node.name.value == before
    )
    return module.with_changes(body=[*body[:at], cls, *body[at:]])


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    att = ctx.plan.attention
    if isinstance(att, MlaPlan):  # passes/mla_attention.py
        return PassResult(module=module)
    cls = t.find_class(module, att.module_class)
    cls, notes = rewrite_attention(cls, ctx, frozenset(t.top_level_names(module)))
    style = "neox" if att.rope_neox else "GPT-J (interleaved)"
    rope = "ReversedRotaryEmbedding (turning by -theta, " if att.rope_reversed else "get_rope ("
    rope = (
        f"{rope}{style} style, rotary dim {att.rotary_dim} of {att.head_dim}"
        + (", parameters per layer type" if att.rope_per_layer_type else "")
        + "; proven by replay)"
    )
    softcap = f", logit soft cap {att.logit_softcap:g}" if att.logit_softcap else ""
    if att.alibi:
        rope = f"ALiBi slopes x {att.alibi} (bias proven by replay)"
    rows = [FusionRow(att.module_class, f"attention interface -> vllm Attention{softcap} + {rope}")]
    rows += [FusionRow(att.module_class, note) for note in notes]
    imports = ["Attention", "RotaryEmbedding" if att.rope_reversed else "get_rope"]
    if att.alibi:
        imports = ["Attention", "get_tensor_model_parallel_rank"]
        at = next(
            i
            for i, n in enumerate(module.body)
            if isinstance(n, cst.ClassDef) and n.name.value == att.module_class
        )
        module = module.with_changes(body=[*module.body[:at], t.stmt(ALIBI_SLOPES), *module.body[at:]])
    if att.sinks:
        imports += ["set_weight_attrs", "sharded_weight_loader"]
        rows.append(
            FusionRow(att.module_class, f"{att.sinks} -> Attention(sinks=...), one per head of each rank")
        )
    sites = Sites()
    module = sites.replace_class(module, att.module_class, cls)
    if att.rope_reversed:
        module = _with_class_before(
            module,
            template_class("rope.py", "ReversedRotaryEmbedding", {}, {}),
            att.module_class,
        )
    if att.q_norm:
        where = "after" if att.qk_norm_after_rope else "before"
        rows.append(
            FusionRow(
                att.module_class,
                f"{att.q_norm}/{att.k_norm} kept (over {att.qk_norm_over}, {where} the rope)",
            )
        )
    if att.qk_norm_over == "all_heads":
        imports += [
            "get_tensor_model_parallel_rank",
            "get_tensor_model_parallel_world_size",
            "tensor_model_parallel_all_gather",
        ]
    return PassResult(
        module=module,
        imports=tuple(imports),
        fused=tuple(rows),
        matches=sites.count,
    )
