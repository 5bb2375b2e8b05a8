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

A hand-written attention the analysis folded (analyze/manual_attention.py) gets the scale it
proved (the default, or 1.0 where the scores are not scaled at all: GPT-Neo); where its scores
are selected by a mask buffer proven a causal band (analyze/mask_window.py), each layer's
window is read off the mask its own ``__init__`` builds: ``causal_window(bias)``.

Attention sinks the call passes (``s_aux=self.sinks``) go to ``Attention(sinks=...)``, cut to
the rank's heads; statements between the fused projection and its split (dbrx's ``clip_qkv``
clamp, proven elementwise) are kept.

A number times k (analyze/path_scale.py) is folded into the scale; one times v, and v heads
narrower than q's and k's (zero-padded around ``self.attn``), are emit/value_heads.py's. Sinks
built on some layers only (``nn.Parameter(...) if is_swa else None``) keep the source's test.

A norm of the whole attention output before its projection (analyze/output_norm.py: BitNet's
sub-norm) is the source's module, called after ``self.attn`` on the heads all ranks gather;
``row_parallel`` then builds the projection with ``input_is_parallel=False``.

An output gate the analysis proved by replay (analyze/output_gate.py: the attention output
times ``act(gate(x))``, per lane or per head: AFMoE, Laguna) is computed after ``self.attn``
from the table row's expression, in float32 where the source computes it so; ``row_parallel``
makes its projection column-parallel.

Preconditions: the attention call passes ``scaling=``; ``forward`` starts with the ``fuse_qkv``
split; ``self.attn`` and ``self.rotary_emb`` are free names; after the split the source only
reshapes q/k/v, applies the plan's q/k norms, calls the functions the analysis proved compute
nothing the plan does not account for (``AttentionPlan.replaced_calls``), the cache update,
the attention call and the output projection; any other op is refused rather than dropped.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from hfrewrite.analyze.plan import AttentionPlan, MlaPlan
from hfrewrite.analyze.rope_styles import RopeTurn
from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.after_split import (
    HEAD_DIM,
    AfterSplit,
    forward_tail,
    positionless,
    qk_norms,
    read_after_split,
    untaken_guards,
)
from hfrewrite.emit.attention_body import AttentionCallKwargs, config_switch, unrecognised
from hfrewrite.emit.attention_rows import kept_rows, replacement_row
from hfrewrite.emit.chunked_attention import chunked_attention
from hfrewrite.emit.given_residual import projection_at, residual_param
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites
from hfrewrite.emit.position_code import (
    ALIBI_INIT,
    ALIBI_SLOPES,
    CAUSAL_WINDOW,
    NO_POSITIONS,
    SOURCE_ROPE_THETA,
    rope_init,
    rotary_builders,
)
from hfrewrite.emit.shared_matchers import QKV_PROJECTION
from hfrewrite.emit.templates_io import insert_before, template_class
from hfrewrite.emit.value_heads import key_scaled
from hfrewrite.errors import HfrewriteError

NAME = "vllm_attention"

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


def _attention_kwargs(cls: cst.ClassDef, att: AttentionPlan) -> dict[str, cst.BaseExpression]:
    """The keyword arguments of the source's attention call, ``scaling=`` among them."""
    finder, name = AttentionCallKwargs(), cls.name.value
    t.find_method(cls, "forward").visit(finder)
    if att.attention_call.direct:  # proven causal: its call is among replaced_calls
        finder.kwargs = {"scaling": t.expr(att.attention_call.scaling)}
        if att.window_mask:  # each layer's window, read off the mask its __init__ builds
            finder.kwargs["sliding_window"] = t.expr(f"causal_window({_buffer_value(cls, att.window_mask)})")
    if finder.kwargs is None or "scaling" not in finder.kwargs:
        raise HfrewriteError(f"{name}: {NAME}: no attention_interface(..., scaling=...) call in forward")
    return finder.kwargs


def _buffer_value(cls: cst.ClassDef, attr: str) -> str:
    """What ``__init__`` makes the buffer ``self.<attr>`` of: the local it wraps in
    ``nn.Buffer(local, ...)`` (the buffer itself then goes, unread), else ``self.<attr>``."""
    for s in t.find_method(cls, "__init__").body.body:
        value = t.assigned_value(s) if t.self_attr_assigned(s) == attr else None
        if t.call_name(value) in ("nn.Buffer", "torch.nn.Buffer") and isinstance(
            value.args[0].value, cst.Name
        ):
            return value.args[0].value.value
    return f"self.{attr}"


def _init_without_source_rope(init: cst.FunctionDef, att: AttentionPlan, name: str) -> cst.FunctionDef:
    """``__init__`` without the source's rotary module where the proven rope replaces it;
    refuses where ``self.attn`` or ``self.rotary_emb`` stay taken."""
    if "rotary_emb" in att.replaced_calls:  # the source's rotary module: the proven rope
        init = t.with_body(init, [s for s in init.body.body if t.self_attr_assigned(s) != "rotary_emb"])
    if att.rope_table is not None:  # rebuilt where the base is read off its table
        init = t.with_body(
            init, [s for s in init.body.body if t.self_attr_assigned(s) != att.rope_table.child]
        )
    assigned = {t.self_attr_assigned(s) for s in init.body.body}
    if {"attn", "rotary_emb"} & assigned:
        raise HfrewriteError(f"{name}: {NAME}: self.attn / self.rotary_emb already exist")
    return init


def _split_at(body: list[cst.BaseStatement], name: str) -> int:
    """Where fuse_qkv's ``q, k, v = qkv.split(...)`` is."""
    split_at = next((i for i, s in enumerate(body) if m.matches(s, _QKV_SPLIT)), None)
    if split_at is None:
        raise HfrewriteError(f"{name}: {NAME}: forward has no q/k/v split (run fuse_qkv first)")
    return split_at


def _attention_options(kwargs: dict[str, cst.BaseExpression], att: AttentionPlan) -> str:
    """``Attention(...)``'s keyword lines carried from the source's call, and its sinks."""
    window = (
        f"    per_layer_sliding_window={t.code(kwargs['sliding_window'])},\n"
        if "sliding_window" in kwargs
        else ""
    )
    if "softcap" in kwargs:
        window += f"    logits_soft_cap={t.code(kwargs['softcap'])},\n"
    if att.sinks:
        window += f"    sinks=self.{att.sinks},\n"
    return window


def _rope_parameters(att: AttentionPlan, init: cst.FunctionDef, name: str) -> str:
    """The expression ``get_rope`` reads the rope parameters from."""
    rope_parameters = "config.rope_parameters"
    if att.rope_table is not None:  # the base the source's rotary module computes
        return '{"rope_type": "default", "rope_theta": rope_theta}'
    if att.rope_fields:  # a transformers 4.x config: the fields the replay read, by name
        entries = ", ".join(  # a field of the config, or the source's constant base
            f'"{key}": {field if field[0].isdigit() or field.startswith("config.") else "config." + field}'
            for key, field in att.rope_fields
        )
        rope_parameters = '{"rope_type": "default", ' + entries + "}"
    if att.rotary_dim_field:  # GPT-J: the rotated width in lanes, as a share of the head
        rope_parameters = (
            f'{{**{rope_parameters}, "partial_rotary_factor": config.{att.rotary_dim_field} / {HEAD_DIM}}}'
        )
    if att.rope_per_layer_type:  # {layer type: parameters}: this layer's entry
        if "layer_idx" not in {p.name.value for p in init.params.params}:
            raise HfrewriteError(
                f"{name}: {NAME}: rope parameters per layer type, but __init__ has no layer_idx"
            )
        rope_parameters = "config.rope_parameters[config.layer_types[layer_idx]]"
    return rope_parameters


def _init_with_attention(
    init: cst.FunctionDef,
    cls: cst.ClassDef,
    att: AttentionPlan,
    kwargs: dict[str, cst.BaseExpression],
    untaken: tuple[cst.BaseExpression, ...],
) -> cst.FunctionDef:
    """``__init__`` building vLLM's rope (or ALiBi slopes) and ``Attention``."""
    name = cls.name.value
    scaling = t.code(kwargs["scaling"])
    if att.q_prescale:  # q multiplied by it after its projection, the call at its own scale
        scaling = att.q_prescale if scaling in ("1", "1.0") else f"{att.q_prescale} * {scaling}"
    scaling = key_scaled(att, scaling)
    options = _attention_options(kwargs, att)
    if att.sinks:
        init = _sinks_per_rank(init, att.sinks, name)
    rope_parameters = _rope_parameters(att, init, name)
    # untaken switches on config fields go first; one on a computed attribute after the sources
    first, later = untaken_guards(untaken, cls)
    return t.with_body(
        init,
        [
            *t.guards_first(list(init.body.body), first),
            *t.stmts(
                later
                + (
                    ALIBI_INIT.format(factor=att.alibi)
                    if att.alibi
                    else ""
                    if positionless(att)  # learned positions, added to the embeddings
                    else _source_rope_theta(cls, att) + rope_init(att, HEAD_DIM, rope_parameters)
                )
                + chunked_attention(att, init, name)
                + f"self.attn = {'attention_class' if att.attention_chunk else 'Attention'}(\n"
                "    self.num_heads,\n"
                f"    {HEAD_DIM},\n"
                f"    {scaling},\n"
                "    num_kv_heads=self.num_kv_heads,\n"
                "    cache_config=cache_config,\n"
                "    quant_config=quant_config,\n"
                f"{options}"
                + ("    alibi_slopes=alibi_slopes,\n" if att.alibi else "")
                + ("    **chunked,\n" if att.attention_chunk else "")
                + '    prefix=f"{prefix}.attn",\n'
                ")\n"
            ),
        ],
    )


def _source_rope_theta(cls: cst.ClassDef, att: AttentionPlan) -> str:
    """``rope_theta = source_rope_theta(...)``: the base read off the table of the source's
    rotary module, built as its ``__init__`` builds it, where the analysis proved that table."""
    if att.rope_table is None:
        return ""
    table, name = att.rope_table, cls.name.value
    built = [
        t.assigned_value(s)
        for s in t.find_method(cls, "__init__").body.body
        if t.self_attr_assigned(s) == table.child
    ]
    if len(built) != 1 or att.rotary_dim != att.head_dim:
        raise HfrewriteError(
            f"{name}: {NAME}: self.{table.child} (its rope table) is not built once, over whole heads"
        )
    return (
        "# The source's rotary module computes the base: read off its table at load.\n"
        "rope_theta = source_rope_theta(\n"
        f"    {t.code(built[0])},\n"
        f"    lambda rope, n: rope({table.call}),\n"
        f"    config.{att.max_position_field},\n"
        f"    {HEAD_DIM},\n"
        ")\n"
    )


def _vllm_forward(
    forward: cst.FunctionDef, split_at: int, tail: str, residual: str | None, name: str
) -> cst.FunctionDef:
    """vLLM's ``forward(positions, hidden_states)``: the kept projection, then ``tail``."""
    body = list(forward.body.body)
    kept = _input_as_hidden_states(forward, body[_projection_at(body, split_at, name) : split_at + 1], name)
    given = f", {residual}: torch.Tensor" if residual is not None else ""
    params = t.stmt(
        f"def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor{given}) -> torch.Tensor:\n"
        "    pass\n"
    )
    forward = forward.with_changes(
        params=params.params,
        returns=params.returns,
        whitespace_before_params=params.whitespace_before_params,
    )
    return t.with_body(forward, [*kept, *t.stmts(tail)])


def _notes(source: AfterSplit) -> list[str]:
    """What ``--explain`` says was carried or guarded."""
    rope_test, norm_test = source.rope_test, source.norm_test
    notes = [f"rope only where the source's `{t.code(rope_test)}` holds (NoPE layers)"] if rope_test else []
    notes += [
        f"config branch `if {t.code(test)}:` never traced: the file refuses configs that take it"
        for test in source.untaken
    ]
    notes += [f"`if {' '.join(t.code(c.test).split())}:` carried from the source" for c in source.carried]
    notes += [f"q/k norms under the source's `if {t.code(norm_test)}:`"] if norm_test is not None else []
    return notes


def _without_rotary_builders(cls: cst.ClassDef) -> cst.ClassDef:
    """``cls`` without the calls in ``__init__`` (``self._init_rope()``) that only built the
    source's rotary module."""
    builders = rotary_builders(cls)
    init = t.find_method(cls, "__init__")
    kept = [s for s in init.body.body if t.code(s).strip() not in builders]
    return t.set_method(cls, t.with_body(init, kept))


def rewrite_attention(
    cls: cst.ClassDef, ctx: PassContext, constants: frozenset[str] = frozenset()
) -> tuple[cst.ClassDef, list[str]]:
    """The rewritten class, and notes for ``--explain`` on what was carried or guarded;
    ``constants``: the names the module binds at its top level."""
    att = ctx.plan.attention
    name = cls.name.value
    init, forward = t.find_method(cls, "__init__"), t.find_method(cls, "forward")
    kwargs = _attention_kwargs(cls, att)
    # no position at all, unless the model's other mixer sees the order (Granite-4.0-H's Mamba-2)
    if positionless(att) and ctx.plan.position_embedding is None and ctx.plan.mixer is None:
        raise HfrewriteError(f"{name}: {NAME}: {NO_POSITIONS}")
    init = _init_without_source_rope(init, att, name)
    body = list(forward.body.body)
    split_at = _split_at(body, name)
    residual, checked = None, body[split_at + 1 :]
    if att.adds_residual:  # what follows the projection adds the given tensor: proven
        residual = residual_param(forward, att.o.attr, name)
        checked = body[split_at + 1 : projection_at(body, att.o.attr) + 1]
    source = read_after_split(cls, forward, split_at, checked, ctx, constants)
    init = _init_with_attention(init, cls, att, kwargs, source.untaken)
    norms, init = qk_norms(init, att, source.norm_test, name)
    tail = forward_tail(att, norms, source, residual, name)
    forward = _vllm_forward(forward, split_at, tail, residual, name)
    cls = t.set_method(t.set_method(cls, init), forward)
    if "rotary_emb" in att.replaced_calls:  # `self._init_rope()`, which only built the source's
        cls = _without_rotary_builders(cls)
    return cls, _notes(source)


# What fuse_qkv carries between the projection and the split: the elementwise ops on the
# whole projection the analysis proved (dbrx's clip_qkv clamp) and the constants they read.
_BEFORE_SPLIT_CALLS = {"clamp", "clip"}


def _projection_at(body: list[cst.BaseStatement], split_at: int, cls: str) -> int:
    """Where ``qkv, _ = self.<proj>(...)`` is, the statements up to the split carried."""
    at = split_at - 1
    while at >= 0 and not m.matches(body[at], QKV_PROJECTION):
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
    built = t.assigned_value(body[at[0]]) if len(at) == 1 else None
    test = None  # `nn.Parameter(...) if <test> else None`: sinks on some layers (MiMo-V2-Flash)
    if isinstance(built, cst.IfExp) and m.matches(built.orelse, m.Name("None")):
        built, test = built.body, built.test
    if t.call_name(built) != "nn.Parameter":
        raise HfrewriteError(f"{cls}: {NAME}: self.{attr} (the attention sinks) is not one nn.Parameter")
    parameter = "nn.Parameter(torch.empty(self.num_heads), requires_grad=False)"
    loader = f'set_weight_attrs(self.{attr}, {{"weight_loader": sharded_weight_loader(0)}})\n'
    new = t.stmts(
        "# Attention sinks: one logit per head, this rank's heads.\n"
        + (
            f"self.{attr} = {parameter} if {t.code(test)} else None\nif self.{attr} is not None:\n    {loader}"
            if test is not None
            else f"self.{attr} = {parameter}\n{loader}"
        )
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
    # the first parameter, else the one the projection reads (CTRL's attention takes (v, k, q),
    # one tensor passed three times, proven: the fused projection reads q)
    read = params[:1] if params and params[0] in used else [p for p in params if p in used]
    if len(read) != 1 or read[0] == "hidden_states":
        return kept
    if "hidden_states" in used:
        raise HfrewriteError(f"{cls}: {NAME}: the input {read[0]} and a local hidden_states")
    fn = t.with_body(forward, kept)
    return list(t.rename_locals(fn, {read[0]: "hidden_states"}).body.body)


def _with_code_before(module: cst.Module, code: str, before: str) -> cst.Module:
    """``module`` with the statements of ``code`` (helper functions) before the class ``before``."""
    at = next(i for i, n in enumerate(module.body) if isinstance(n, cst.ClassDef) and n.name.value == before)
    return module.with_changes(body=[*module.body[:at], *cst.parse_module(code).body, *module.body[at:]])


def _with_template(module: cst.Module, before: str, file: str, name: str) -> cst.Module:
    """``module`` with the class or function ``name`` of ``templates/<file>`` before the class
    ``before``, once however many attention classes need it."""
    if any(isinstance(n, (cst.FunctionDef, cst.ClassDef)) and n.name.value == name for n in module.body):
        return module
    return insert_before(module, before, template_class(file, name, {}, {}))


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    att = ctx.plan.attention
    if att is None or isinstance(att, MlaPlan):  # attention-free; passes/mla_attention.py
        return PassResult(module=module)
    cls = t.find_class(module, att.module_class)
    cls, notes = rewrite_attention(cls, ctx, frozenset(t.top_level_names(module)))
    described = [replacement_row(att, hybrid=ctx.plan.mixer is not None), *notes, *kept_rows(att)]
    rows = [FusionRow(att.module_class, row) for row in described]
    imports = ["Attention", att.rope_turn.vllm_import]
    if att.alibi:
        imports = ["Attention", "get_tensor_model_parallel_rank"]
        module = _with_code_before(module, ALIBI_SLOPES, att.module_class)
    if att.window_mask:
        module = _with_code_before(module, CAUSAL_WINDOW, att.module_class)
    if att.attention_chunk:
        imports.append("ChunkedLocalAttention")
    if att.rope_table is not None:
        module = _with_code_before(module, SOURCE_ROPE_THETA, att.module_class)
    if att.sinks:
        imports += ["set_weight_attrs", "sharded_weight_loader"]
    sites = Sites()
    module = sites.replace_class(module, att.module_class, cls)
    if att.rope_turn is RopeTurn.REVERSED:
        module = _with_template(module, att.module_class, "rope.py", "ReversedRotaryEmbedding")
    if att.output_norm:
        imports.append("tensor_model_parallel_all_gather")
    if att.qk_norm_over == "each_head":
        imports += ["get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"]
        module = _with_template(module, att.module_class, "head_norm.py", "norm_rank_heads")
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
