"""Give the base model and the causal-LM class vLLM's model interface.

Matches the plan's base model (``LlamaModel``) and top-level class (``LlamaForCausalLM``).

Emits, following vLLM's ``llama.py``:

* base model: ``@support_torch_compile``, ``nn.Module`` base, ``__init__(*, vllm_config,
  prefix="")`` whose body keeps the source's statements, with the decoder stack
  ``nn.ModuleList([Layer(config, i) for i in range(N)])`` rewritten to
  ``make_layers(N, lambda prefix: Layer(config, extract_layer_index(prefix), ...))`` (a
  stack choosing one of two classes by a test of the index, OLMo-hybrid's ``A(config, i) if
  config.layer_types[i] == ... else B(config, i)``, keeps that test on the index) and the
  final norm built on the last pipeline stage only; ``embed_input_ids`` and the pipeline-
  parallel ``forward(input_ids, positions, intermediate_tensors, inputs_embeds)`` from
  ``templates/causal_lm.py``.
  The source's statements between the embedding lookup and the layer loop (granite's
  embedding multiplier) are carried onto the first pipeline rank, after the lookup.
* causal LM: the template class (``SupportsLoRA``, ``SupportsPP``, ``SupportsEagle3``, ``compute_logits``,
  ``load_weights``...) with the source's LM-head statements spliced into ``__init__``.
  EAGLE-3 only where vLLM's proposer can share the embeddings (``model.embed_tokens``): a base
  model held under another name (GPT-2's ``transformer``) declares neither ``SupportsEagle3``
  nor ``EagleModelMixin``, and its forward collects no hidden states for a draft.

Preconditions: the decoder stack is a ``ModuleList`` comprehension over ``range(N)``; the
final norm and the stack are assigned in ``__init__``; the causal-LM ``__init__`` builds the
base model under the plan's attribute name.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.embedding_glue import embedding_glue, lookup_expression, position_rows
from hfrewrite.emit.logits_glue import (
    adding_head_bias,
    carrying_logits,
    head_has_bias,
    logits_statements,
    scales_head_input,
    scaling_head_input,
)
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites
from hfrewrite.emit.shared_matchers import SUPER_INIT, builds, nn_call, self_attr
from hfrewrite.emit.taken_init import taken_init_branches
from hfrewrite.emit.templates_io import template_class
from hfrewrite.errors import HfrewriteError

NAME = "vllm_model_interface"
TEMPLATE = "causal_lm.py"


def _is_call_to(node: cst.BaseStatement, func: m.BaseMatcherNode) -> bool:
    """`super().__init__(...)` / `self.post_init()` style expression statements."""
    return m.matches(node, m.SimpleStatementLine(body=[m.Expr(m.Call(func=func)), m.ZeroOrMore()]))


def _layer_stack(value: cst.BaseExpression, cls: str, attr: str) -> str:
    """`make_layers(...)` source for `nn.ModuleList([Layer(...) for i in range(N)])` (or a
    generator, OpenELM's `nn.ModuleList(Layer(...) for i in range(N))`)."""
    lc = value.args[0].value if builds(value, nn_call("ModuleList")) and value.args else None
    gen = lc.for_in if isinstance(lc, cst.ListComp | cst.GeneratorExp) else None
    # one class, or one of two chosen by the index (OLMo-hybrid's `A(...) if ... else B(...)`)
    elt = lc.elt if gen is not None else None
    calls = [elt.body, elt.orelse] if isinstance(elt, cst.IfExp) else [elt]
    if (
        gen is None
        or gen.inner_for_in is not None
        or t.call_name(gen.iter) != "range"
        or not isinstance(gen.target, cst.Name)
        or not all(isinstance(c, cst.Call) for c in calls)
    ):
        raise HfrewriteError(f"{cls}: {NAME}: self.{attr} is not ModuleList([... for i in range(N)])")
    index, count = gen.target.value, t.code(gen.iter.args[0].value)
    # the loop index, wherever the call reads it (Bamba's config.layers_block_type[i] too)
    at = t.expr("extract_layer_index(prefix)")
    built = [_layer_call(c, index, at) for c in calls]
    call = (
        built[0]
        if len(built) == 1
        else f"{built[0]} if {t.code(t.replace_names(elt.test, {index: at}))} else {built[1]}"
    )
    return (
        f"self.start_layer, self.end_layer, self.{attr} = make_layers(\n"
        f"    {count},\n    lambda prefix: {call},\n"
        f'    prefix=f"{{prefix}}.{attr}",\n)\n'
    )


def _layer_call(layer: cst.Call, index: str, at: cst.BaseExpression) -> str:
    """``layer`` with vLLM's arguments, the loop ``index`` read as ``at``."""
    # the index's own name, never an attribute of that name (not keywords)
    args = [a.with_changes(value=t.replace_names(a.value, {index: at})) for a in layer.args]
    extra = "cache_config=cache_config, quant_config=quant_config, prefix=prefix"
    # the class too may be chosen by the index (Jamba's ALL_DECODER_LAYER_TYPES[...[i]])
    func = t.replace_names(layer.func, {index: at})
    return f"{t.code(func)}({', '.join(t.code(a).rstrip(', ') for a in args)}, {extra})"


def _module_list_of(name: str) -> m.Call:
    return m.Call(
        func=m.Attribute(value=m.Name("nn"), attr=m.Name("ModuleList")), args=[m.Arg(value=m.Name(name))]
    )


def folded_layer_loop(statements: list[cst.BaseStatement], attr: str) -> list[cst.BaseStatement]:
    """``statements`` with ``xs = []; for i in range(N): xs.append(Layer(...));
    self.<attr> = nn.ModuleList(xs)`` (Bamba's) written as the one
    ``self.<attr> = nn.ModuleList([Layer(...) for i in range(N)])`` it means."""
    out = list(statements)
    for i in range(len(out) - 2):
        empty, loop, built = out[i : i + 3]
        listed = m.SimpleStatementLine(
            body=[m.Assign(targets=[m.AssignTarget(target=m.Name())], value=m.List(elements=[]))]
        )
        if not (
            m.matches(empty, listed) and isinstance(loop, cst.For) and t.self_attr_assigned(built) == attr
        ):
            continue
        xs = empty.body[0].targets[0].target.value
        *locals_, appended = loop.body.body
        call = m.Call(func=m.Attribute(value=m.Name(xs), attr=m.Name("append")), args=[m.Arg(value=m.Call())])
        bound = _bound_locals(locals_)
        if not (
            m.matches(appended, m.SimpleStatementLine(body=[m.Expr(value=call)]))
            and bound is not None
            and loop.orelse is None
            and m.matches(t.assigned_value(built), _module_list_of(xs))
        ):
            continue
        element = t.code(_substituted(appended.body[0].value.args[0].value, bound))
        stacked = t.stmt(
            f"self.{attr} = nn.ModuleList([{element} for {t.code(loop.target)} in {t.code(loop.iter)}])\n"
        )
        return [*out[:i], stacked.with_changes(leading_lines=empty.leading_lines), *out[i + 3 :]]
    return out


def _bound_locals(statements: list[cst.BaseStatement]) -> dict[str, cst.BaseExpression] | None:
    """The loop body's ``name = <expression>`` lines before its append (Jamba's ``layer_class =
    ALL_DECODER_LAYER_TYPES[config.layers_block_type[i]]``), each expression with the earlier
    names substituted; None when a line is anything else."""
    bound: dict[str, cst.BaseExpression] = {}
    one_name = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())])])
    for statement in statements:
        if not m.matches(statement, one_name):
            return None
        assign = statement.body[0]
        bound[assign.targets[0].target.value] = _substituted(assign.value, bound)
    return bound


def _substituted(expression: cst.BaseExpression, bound: dict[str, cst.BaseExpression]) -> cst.BaseExpression:
    """``expression`` with each name ``bound`` holds replaced by its (parenthesised) expression."""
    atomic = cst.Name | cst.Attribute | cst.Subscript | cst.Call
    return t.replace_names(
        expression,
        {
            name: value
            if isinstance(value, atomic)
            else value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
            for name, value in bound.items()
        },
    )


def rewrite_base_model(cls: cst.ClassDef, ctx: PassContext) -> cst.ClassDef:
    """The base model ``cls`` as vLLM's: its ``__init__``, ``embed_input_ids`` and ``forward``."""
    plan = ctx.plan
    name = cls.name.value
    tpl = template_class(
        TEMPLATE,
        "TemplateModel",
        {"TemplateModel": name},
        {
            "embed_tokens": plan.embed_tokens,
            "layers": plan.layers,
            "norm": plan.final_norm or "norm",
        },
    )
    if plan.position_embedding is None:
        glue = embedding_glue(t.find_method(cls, "forward"), plan.layers, plan.embed_tokens, name)
    else:  # proven: the first layer reads the tokens' rows plus the position rows, nothing else
        glue = t.stmts(position_rows(plan.position_embedding))
    new_init = _base_init(cls, tpl, plan, glue)
    forward = _base_forward(tpl, plan)
    mixins = [cst.Arg(t.expr("EagleModelMixin"))]
    if not eagle3_drafts_fit(plan):  # no draft can run on it: nothing to collect
        forward, mixins = forward.visit(_WithoutAuxStates()), []
    lookup = lookup_expression(t.find_method(cls, "forward"), plan.embed_tokens, name)
    if plan.embeddings_transformed and not glue and lookup is None:
        raise HfrewriteError(
            f"{name}: {NAME}: the first layer does not read the embeddings as they are, "
            "and no statements before the layer loop say why"
        )
    if glue:  # on the first pipeline rank, after the lookup
        forward = _after_lookup(forward, glue, learned_positions=plan.position_embedding is not None)
    members = [m for m in cls.body.body if not isinstance(m, cst.FunctionDef)]
    methods = [new_init, _embed_input_ids(tpl, lookup), forward]
    methods = [
        m.with_changes(leading_lines=[cst.EmptyLine()] if (members or i) else [])
        for i, m in enumerate(methods)
    ]
    return cls.with_changes(
        decorators=[cst.Decorator(cst.Name("support_torch_compile"))],
        bases=[cst.Arg(t.expr("nn.Module")), *mixins],
        body=cls.body.with_changes(body=[*members, *methods]),
    )


def _base_init(cls: cst.ClassDef, tpl: cst.ClassDef, plan, glue: list[cst.BaseStatement]) -> cst.FunctionDef:
    """The template's ``__init__`` with the source's statements: the decoder stack built by
    ``make_layers``, the final norm on the pipeline ranks that apply it."""
    name = cls.name.value
    # the branches of the __init__'s config switches the traced config took (OPT's final
    # norm and projections); guards refuse the others
    init, guards = taken_init_branches(t.find_method(cls, "__init__"), plan.base_init_switches, name)
    body: list[cst.BaseStatement] = list(t.find_method(tpl, "__init__").body.body)
    hidden = None
    # nanochat also normalises the embeddings with its final norm: the first rank needs it too
    norm_ranks = "get_pp_group().is_last_rank"
    if f"self.{plan.final_norm}" in {t.dotted(a) for a in m.findall(cst.Module(glue), m.Attribute())}:
        norm_ranks = "get_pp_group().is_first_rank or get_pp_group().is_last_rank"
    for s in folded_layer_loop(list(init.body.body), plan.layers):
        attr = t.self_attr_assigned(s)
        if _is_call_to(s, SUPER_INIT) or _is_call_to(s, self_attr("post_init")):
            continue
        if attr == plan.layers:
            new = t.stmts(_layer_stack(t.assigned_value(s), name, attr))
        elif attr == plan.final_norm:
            norm = t.assigned_value(s)
            hidden = _norm_width(norm)
            new = t.stmts(
                f"if {norm_ranks}:\n"
                f"    self.{attr} = {t.code(norm)}\n"
                "else:\n"
                f"    self.{attr} = PPMissingLayer()\n"
            )
        else:
            body.append(s)
            continue
        new[0] = new[0].with_changes(leading_lines=s.leading_lines)
        body.extend(new)
    if hidden is None and not plan.final_norm:  # no final norm (GPT-1): the stream's width
        hidden = "config.hidden_size"
    if hidden is None:
        built = any(t.self_attr_assigned(s) == plan.final_norm for s in init.body.body)
        how = "over a width read off its arguments" if built else "in __init__"
        raise HfrewriteError(f"{name}: {NAME}: final norm self.{plan.final_norm} not built {how}")
    streams = '["hidden_states", "residual"]' if plan.decoder_layer.fused else '["hidden_states"]'
    body += t.stmts(
        "self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(\n"
        f"    {streams}, {hidden}\n)\n"
    )
    return t.with_body(t.find_method(tpl, "__init__"), t.guards_first(body, guards))


def _norm_width(norm: cst.BaseExpression) -> str | None:
    """The width a final norm is built over: its first argument, the same in both classes a
    config chooses between (Cohere2-MoE's ``RMSNorm(...) if config.rms_norm_eps is not None
    else LayerNorm(...)``, carried as it is); None when it is not read off."""
    if isinstance(norm, cst.IfExp):
        widths = {_norm_width(norm.body), _norm_width(norm.orelse)}
        return widths.pop() if len(widths) == 1 else None
    return t.code(norm.args[0].value) if isinstance(norm, cst.Call) and norm.args else None


def _base_forward(tpl: cst.ClassDef, plan) -> cst.FunctionDef:
    """The template's pipeline-parallel ``forward``: with vLLM's fused residual norms, or
    calling the carried layers as they are."""
    if plan.decoder_layer.fused and not plan.final_norm:
        raise HfrewriteError(f"{plan.base_model_class}: {NAME}: fused residual layers and no final norm")
    if plan.decoder_layer.fused:
        return t.find_method(tpl, "forward")
    carried = template_class(
        TEMPLATE,
        "TemplateCarriedModel",
        {},
        {"layers": plan.layers, "norm": plan.final_norm or "norm"},
    )
    forward = t.find_method(carried, "forward")
    if not plan.final_norm:  # the lm_head reads the last layer's output (GPT-1)
        normed = t.stmt("hidden_states = self.norm(hidden_states)\n")
        body = [s for s in forward.body.body if not s.deep_equals(normed)]
        if len(body) != len(forward.body.body) - 1:
            raise HfrewriteError(f"{plan.base_model_class}: {NAME}: the template's final norm is not found")
        forward = t.with_body(forward, body)
    return forward


_ADD_AUX_STATE = m.Expr(
    m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("_maybe_add_hidden_state")))
)


class _WithoutAuxStates(cst.CSTTransformer):
    """The template's base ``forward`` without the hidden states it collects for an EAGLE-3
    draft (``aux_hidden_states``), and without their alternative in its return annotation."""

    def leave_SimpleStatementLine(self, original, updated):
        aux = m.AnnAssign(target=m.Name("aux_hidden_states"))
        if m.matches(updated, m.SimpleStatementLine(body=[aux | _ADD_AUX_STATE])):
            return cst.RemoveFromParent()
        return updated

    def leave_If(self, original, updated):
        collects = m.IndentedBlock(body=[m.SimpleStatementLine(body=[_ADD_AUX_STATE])])
        if m.matches(original, m.If(body=collects) | m.If(test=m.Name("aux_hidden_states"))):
            return cst.RemoveFromParent()
        return updated

    def leave_FunctionDef(self, original, updated):
        body = [  # the layer loop set apart by a blank line, as the collection was
            s.with_changes(leading_lines=[cst.EmptyLine()])
            if isinstance(s, cst.For) and not s.leading_lines
            else s
            for s in updated.body.body
        ]
        updated = t.with_body(updated, body)
        returns = updated.returns.annotation if updated.returns else None
        if m.matches(returns, m.BinaryOperation(right=m.Subscript(value=m.Name("tuple")))):
            return updated.with_changes(returns=updated.returns.with_changes(annotation=returns.left))
        return updated


def _after_lookup(
    forward: cst.FunctionDef, glue: list[cst.BaseStatement], learned_positions: bool
) -> cst.FunctionDef:
    """``forward`` with ``glue`` run on the first pipeline rank, after the embedding lookup."""
    why = (
        "Learned absolute positions: each token's row of the position table."
        if learned_positions
        else "The source's own step between the embeddings and the first layer."
    )
    head = forward.body.body[0]
    first = glue[0].with_changes(
        leading_lines=[
            *t.stmts(f"# {why}\npass\n")[0].leading_lines,
            *[line for line in glue[0].leading_lines if line.comment],
        ]
    )
    head = head.with_changes(
        body=head.body.with_changes(body=[*head.body.body[:1], first, *glue[1:], *head.body.body[1:]])
    )
    return t.with_body(forward, [head, *forward.body.body[1:]])


def _embed_input_ids(tpl: cst.ClassDef, lookup: cst.BaseExpression | None) -> cst.FunctionDef:
    """The template's ``embed_input_ids``, returning the source's expression around its
    lookup when it has one (:func:`lookup_expression`)."""
    embed_input_ids = t.find_method(tpl, "embed_input_ids")
    if lookup is None:
        return embed_input_ids
    comment = cst.EmptyLine(comment=cst.Comment("# The source's own expression around the lookup."))
    return t.with_body(
        embed_input_ids, [cst.SimpleStatementLine([cst.Return(lookup)], leading_lines=[comment])]
    )


def rewrite_causal_lm(cls: cst.ClassDef, ctx: PassContext) -> cst.ClassDef:
    """The template causal LM with the source's lm_head and its logits' post-processing."""
    plan = ctx.plan
    tpl = template_class(
        TEMPLATE,
        "TemplateForCausalLM",
        {
            "TemplateForCausalLM": plan.architecture,
            "TemplateModel": plan.base_model_class,
        },
        {"model": plan.base_model_attr, "lm_head": plan.lm_head},
    )
    source_init = t.find_method(cls, "__init__")
    head = [s for s in source_init.body.body if plan.lm_head in t.self_attrs_used(s)]
    if not head:
        raise HfrewriteError(f"{plan.architecture}: {NAME}: self.{plan.lm_head} not built in __init__")
    carried = (  # a proven soft cap is LogitsProcessor's (parallel_embedding)
        [] if plan.logit_soft_cap else logits_statements(t.find_method(cls, "forward"), plan.lm_head)
    )
    if plan.logits_postprocessed and not carried and not plan.logit_soft_cap:
        raise HfrewriteError(
            f"{plan.architecture}: {NAME}: the logits are post-processed, but not by "
            f"statements right after `logits = self.{plan.lm_head}(...)`"
        )
    # attributes the carried statements read (`self.logit_scale = config.logit_scale`), not
    # the base model the template builds (Falcon-H1's `self.model.lm_head_multiplier`)
    reads = set().union(*(t.self_attrs_used(s) for s in carried)) - {"config", plan.base_model_attr}
    head += [s for s in source_init.body.body if t.self_attr_assigned(s) in reads and s not in head]
    tpl = _with_head_built(tpl, plan.base_model_attr, head)
    bias = head_has_bias(head)
    if bias:  # the source's lm_head has a bias: the logits add it
        tpl = adding_head_bias(tpl, plan.lm_head)
    if carried:
        tpl = carrying_logits(tpl, plan.lm_head, carried, bias)
    forward = t.find_method(cls, "forward")
    if plan.head_input_scaled or scales_head_input(forward, plan.lm_head):  # after the carried logits
        tpl = scaling_head_input(tpl, forward, plan)
    if not eagle3_drafts_fit(plan):
        tpl = _without_eagle3(tpl)
    return tpl.with_changes(leading_lines=cls.leading_lines)


def eagle3_drafts_fit(plan) -> bool:
    """vLLM's EAGLE-3 proposer shares the target's embeddings, which it finds at
    ``model.embed_tokens`` (or ``model.embedding``) only: a base model held under another
    name (GPT-2's ``transformer``) keeps the checkpoint's names and declares no EAGLE-3."""
    return plan.base_model_attr == "model" and plan.embed_tokens in ("embed_tokens", "embedding")


_EAGLE3_METHODS = ("set_aux_hidden_state_layers", "get_eagle3_default_aux_hidden_state_layers")


def _without_eagle3(tpl: cst.ClassDef) -> cst.ClassDef:
    """``tpl`` without ``SupportsEagle3`` and its two methods."""
    body = [
        s for s in tpl.body.body if not (isinstance(s, cst.FunctionDef) and s.name.value in _EAGLE3_METHODS)
    ]
    bases = [b for b in tpl.bases if not m.matches(b.value, m.Name("SupportsEagle3"))]
    return tpl.with_changes(bases=bases, body=tpl.body.with_changes(body=body))


def _with_head_built(tpl: cst.ClassDef, base_model_attr: str, head: list[cst.BaseStatement]) -> cst.ClassDef:
    """``tpl`` whose ``__init__`` runs the source's ``head`` statements after building the
    base model."""
    init = t.find_method(tpl, "__init__")
    body = list(init.body.body)
    at = next(i for i, s in enumerate(body) if t.self_attr_assigned(s) == base_model_attr) + 1
    body[at:at] = head
    return t.set_method(tpl, t.with_body(init, body))


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    plan = ctx.plan
    base = rewrite_base_model(t.find_class(module, plan.base_model_class), ctx)
    sites = Sites()  # the base model and the causal LM
    module = sites.replace_class(module, plan.base_model_class, base)
    module = sites.replace_class(
        module,
        plan.architecture,
        rewrite_causal_lm(t.find_class(module, plan.architecture), ctx),
    )
    return PassResult(
        module=module,
        imports=(
            "support_torch_compile",
            "VllmConfig",
            "IntermediateTensors",
            "get_pp_group",
            "PPMissingLayer",
            "make_layers",
            "extract_layer_index",
            "make_empty_intermediate_tensors_factory",
            "maybe_prefix",
            "islice",
            "Iterable",
            "SupportsLoRA",
            "SupportsPP",
            "SupportsEagle3",
            "EagleModelMixin",
            "AutoWeightsLoader",
        ),
        fused=(
            FusionRow(
                plan.base_model_class,
                f"{plan.layers} -> make_layers (pipeline parallel), torch.compile",
            ),
            FusionRow(
                plan.architecture,
                f"vLLM model interface (SupportsLoRA, SupportsPP{', SupportsEagle3' * eagle3_drafts_fit(plan)})",
            ),
            *(
                [
                    FusionRow(
                        plan.architecture,
                        f"final-logit soft cap -> LogitsProcessor(soft_cap=config.{plan.logit_soft_cap})"
                        if plan.logit_soft_cap
                        else "logits post-processing carried from the source into compute_logits",
                    )
                ]
                if plan.logits_postprocessed
                else []
            ),
        ),
        matches=sites.count,
    )
