"""Give the base model and the causal-LM class vLLM's model interface.

Matches the plan's base model (``LlamaModel``) and top-level class (``LlamaForCausalLM``).

Emits, following vLLM's ``llama.py``:

* base model: ``@support_torch_compile``, ``nn.Module`` base, ``__init__(*, vllm_config,
  prefix="")`` whose body keeps the source's statements, with the decoder stack
  ``nn.ModuleList([Layer(config, i) for i in range(N)])`` rewritten to
  ``make_layers(N, lambda prefix: Layer(config, extract_layer_index(prefix), ...))`` and the
  final norm built on the last pipeline stage only; ``embed_input_ids`` and the pipeline-
  parallel ``forward(input_ids, positions, intermediate_tensors, inputs_embeds)`` from
  ``templates/causal_lm.py``.
  The source's statements between the embedding lookup and the layer loop (granite's
  embedding multiplier) are carried onto the first pipeline rank, after the lookup.
* causal LM: the template class (``SupportsLoRA``, ``SupportsPP``, ``compute_logits``,
  ``load_weights``...) with the source's LM-head statements spliced into ``__init__``.

Preconditions: the decoder stack is a ``ModuleList`` comprehension over ``range(N)``; the
final norm and the stack are assigned in ``__init__``; the causal-LM ``__init__`` builds the
base model under the plan's attribute name.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites
from hfrewrite.emit.templates_io import template_class
from hfrewrite.errors import HfrewriteError

NAME = "vllm_model_interface"
TEMPLATE = "causal_lm.py"


def _is_call_to(node: cst.BaseStatement, name: str) -> bool:
    """`super().__init__(...)` / `self.post_init()` style expression statements."""
    return (
        isinstance(node, cst.SimpleStatementLine)
        and isinstance(node.body[0], cst.Expr)
        and isinstance(node.body[0].value, cst.Call)
        and t.code(node.body[0].value.func) == name
    )


def _layer_stack(value: cst.BaseExpression, cls: str, attr: str) -> str:
    """`make_layers(...)` source for `nn.ModuleList([Layer(...) for i in range(N)])`."""
    lc = value.args[0].value if t.call_name(value) == "nn.ModuleList" and value.args else None
    gen = lc.for_in if isinstance(lc, cst.ListComp) else None
    if (
        gen is None
        or gen.inner_for_in is not None
        or t.call_name(gen.iter) != "range"
        or not isinstance(gen.target, cst.Name)
        or not isinstance(lc.elt, cst.Call)
    ):
        raise HfrewriteError(f"{cls}: {NAME}: self.{attr} is not ModuleList([... for i in range(N)])")
    index, count = gen.target.value, t.code(gen.iter.args[0].value)
    layer = lc.elt
    args = [
        a.with_changes(value=t.expr("extract_layer_index(prefix)"))
        if isinstance(a.value, cst.Name) and a.value.value == index
        else a
        for a in layer.args
    ]
    extra = "cache_config=cache_config, quant_config=quant_config, prefix=prefix"
    call = f"{t.code(layer.func)}({', '.join(t.code(a).rstrip(', ') for a in args)}, {extra})"
    return (
        f"self.start_layer, self.end_layer, self.{attr} = make_layers(\n"
        f"    {count},\n    lambda prefix: {call},\n"
        f'    prefix=f"{{prefix}}.{attr}",\n)\n'
    )


_GLUE_NAMES = {"self", "torch", "nn", "F", "math", "None", "True", "False"}


def _embedding_glue(
    forward: cst.FunctionDef | None, layers: str, embed: str, cls: str
) -> list[cst.BaseStatement]:
    """The source's statements that turn the embeddings into the first layer's input
    (granite's ``inputs_embeds * self.embedding_multiplier``, nanochat's norm), with the
    stream renamed to ``hidden_states``: a backward slice from the layer loop's input
    over the top-level statements, stopping at the embedding lookup. Statements that read
    anything but the stream, ``self`` and libraries refuse (masks, positions, caches)."""
    body = list(forward.body.body) if forward is not None else []
    loop = next(
        (
            i
            for i, s in enumerate(body)
            if isinstance(s, cst.For)
            and f"self.{layers}" in {t.dotted(n) for n in m.findall(s.iter, m.Attribute())}
        ),
        None,
    )
    if loop is None:
        return []
    calls = m.findall(body[loop].body, m.Call())
    first = calls[0].args[0].value if calls and calls[0].args else None
    if not isinstance(first, cst.Name):
        return []
    stream, needed, sliced = {first.value}, {first.value}, []
    for s in reversed(body[:loop]):
        small = s.body[0] if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 else None
        target = (
            small.targets[0].target if isinstance(small, cst.Assign) and len(small.targets) == 1 else None
        )
        lookup = {t.dotted(c.func) for c in m.findall(s, m.Call())} & {f"self.{embed}"}
        if (isinstance(s, cst.If) or lookup) and _assigned(s) & needed:
            # `if inputs_embeds is None: inputs_embeds = self.embed_tokens(...)`: the lookup
            stream |= _assigned(s) & needed
            break
        if not (isinstance(target, cst.Name) and target.value in needed):
            continue
        reads = t.root_names(small.value) - _GLUE_NAMES
        if isinstance(small.value, cst.Name):  # `hidden_states = inputs_embeds`: the same stream
            stream.add(small.value.value)
        else:
            sliced.insert(0, s)
        needed = (needed - {target.value}) | reads
    stranger = sorted(
        t.root_names(cst.Module(sliced)) - _GLUE_NAMES - stream - {n for s in sliced for n in _assigned(s)}
    )
    if stranger:
        raise HfrewriteError(
            f"{cls}: {NAME}: the embeddings are changed with {', '.join(stranger)} before the first layer"
        )

    class _Rename(cst.CSTTransformer):
        def leave_Name(self, original, updated):
            return updated.with_changes(value="hidden_states") if updated.value in stream else updated

        def leave_SimpleStatementLine(self, original, updated):  # a trailing comment leads instead
            comment = updated.trailing_whitespace.comment
            if comment is None:
                return updated
            return updated.with_changes(
                leading_lines=[*updated.leading_lines, cst.EmptyLine(comment=comment)],
                trailing_whitespace=cst.TrailingWhitespace(),
            )

    return [s.visit(_Rename()) for s in sliced]


def _lookup_expression(forward: cst.FunctionDef | None, embed: str, cls: str) -> cst.BaseExpression | None:
    """The source's own expression around its embedding lookup, when it is more than the
    lookup (``self.embed_tokens(input_ids) * scale``), with the lookup reading
    ``input_ids``: the body of ``embed_input_ids``. None for a bare lookup."""

    def looks_up(node: cst.CSTNode) -> bool:
        return any(t.dotted(c.func) == f"self.{embed}" for c in m.findall(node, m.Call()))

    assigned = [a.value for a in m.findall(forward, m.Assign() | m.AnnAssign())] if forward else []
    values = [v for v in assigned if v is not None and looks_up(v)]
    if len(values) != 1 or (isinstance(values[0], cst.Call) and t.dotted(values[0].func) == f"self.{embed}"):
        return None  # a bare lookup (or none to read)

    class _Ids(cst.CSTTransformer):
        def leave_Call(self, original, updated):
            if t.dotted(updated.func) == f"self.{embed}":
                return updated.with_changes(args=[cst.Arg(cst.Name("input_ids"))])
            return updated

    stranger = sorted(t.root_names(values[0]) - _GLUE_NAMES - {"input_ids"})
    if stranger:
        raise HfrewriteError(f"{cls}: {NAME}: the embedding lookup is computed with {', '.join(stranger)}")
    return values[0].visit(_Ids())


def _position_rows(position) -> str:
    """The statement adding the learned position rows to the looked-up tokens."""
    if position.module_call:
        rows = f"self.{position.attr}(positions)"
    else:  # the source's class computes the positions itself; its table is read directly
        shifted = f"positions + {position.offset}" if position.offset else "positions"
        rows = f"self.{position.attr}.weight[{shifted}]"
    return f"hidden_states = hidden_states + {rows}\n"


def rewrite_base_model(cls: cst.ClassDef, ctx: PassContext) -> cst.ClassDef:
    plan = ctx.plan
    name = cls.name.value
    tpl = template_class(
        TEMPLATE,
        "TemplateModel",
        {"TemplateModel": name},
        {
            "embed_tokens": plan.embed_tokens,
            "layers": plan.layers,
            "norm": plan.final_norm,
        },
    )
    init = t.find_method(cls, "__init__")
    body: list[cst.BaseStatement] = list(t.find_method(tpl, "__init__").body.body)
    hidden = None
    if plan.position_embedding is None:
        glue = _embedding_glue(t.find_method(cls, "forward"), plan.layers, plan.embed_tokens, name)
    else:  # proven: the first layer reads the tokens' rows plus the position rows, nothing else
        glue = t.stmts(_position_rows(plan.position_embedding))
    # nanochat also normalises the embeddings with its final norm: the first rank needs it too
    norm_ranks = "get_pp_group().is_last_rank"
    if f"self.{plan.final_norm}" in {t.dotted(a) for a in m.findall(cst.Module(glue), m.Attribute())}:
        norm_ranks = "get_pp_group().is_first_rank or get_pp_group().is_last_rank"
    for s in init.body.body:
        attr = t.self_attr_assigned(s)
        if _is_call_to(s, "super().__init__") or _is_call_to(s, "self.post_init"):
            continue
        if attr == plan.layers:
            new = t.stmts(_layer_stack(t.assigned_value(s), name, attr))
        elif attr == plan.final_norm:
            norm = t.assigned_value(s)
            hidden = t.code(norm.args[0].value) if isinstance(norm, cst.Call) and norm.args else None
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
    if hidden is None:
        raise HfrewriteError(f"{name}: {NAME}: final norm self.{plan.final_norm} not built in __init__")
    fused = plan.decoder_layer.fused
    streams = '["hidden_states", "residual"]' if fused else '["hidden_states"]'
    body += t.stmts(
        "self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(\n"
        f"    {streams}, {hidden}\n)\n"
    )
    new_init = t.with_body(t.find_method(tpl, "__init__"), body)
    members = [m for m in cls.body.body if not isinstance(m, cst.FunctionDef)]
    forward = t.find_method(
        tpl
        if fused
        else template_class(
            TEMPLATE,
            "TemplateCarriedModel",
            {},
            {"layers": plan.layers, "norm": plan.final_norm},
        ),
        "forward",
    )
    lookup = _lookup_expression(t.find_method(cls, "forward"), plan.embed_tokens, name)
    if plan.embeddings_transformed and not glue and lookup is None:
        raise HfrewriteError(
            f"{name}: {NAME}: the first layer does not read the embeddings as they are, "
            "and no statements before the layer loop say why"
        )
    if glue:  # on the first pipeline rank, after the lookup
        why = (
            "The source's own step between the embeddings and the first layer."
            if plan.position_embedding is None
            else "Learned absolute positions: each token's row of the position table."
        )
        head = forward.body.body[0]
        glue[0] = glue[0].with_changes(
            leading_lines=[
                *t.stmts(f"# {why}\npass\n")[0].leading_lines,
                *[line for line in glue[0].leading_lines if line.comment],
            ]
        )
        head = head.with_changes(
            body=head.body.with_changes(body=[*head.body.body[:1], *glue, *head.body.body[1:]])
        )
        forward = t.with_body(forward, [head, *forward.body.body[1:]])
    embed_input_ids = t.find_method(tpl, "embed_input_ids")
    if lookup is not None:  # the source's expression around its lookup
        embed_input_ids = t.with_body(
            embed_input_ids,
            [
                cst.SimpleStatementLine(
                    [cst.Return(lookup)],
                    leading_lines=[
                        cst.EmptyLine(comment=cst.Comment("# The source's own expression around the lookup."))
                    ],
                )
            ],
        )
    methods = [new_init, embed_input_ids, forward]
    methods = [
        m.with_changes(leading_lines=[cst.EmptyLine()] if (members or i) else [])
        for i, m in enumerate(methods)
    ]
    return cls.with_changes(
        decorators=[cst.Decorator(cst.Name("support_torch_compile"))],
        bases=[cst.Arg(t.expr("nn.Module"))],
        body=cls.body.with_changes(body=[*members, *methods]),
    )


_LOGITS_NAMES = {"logits", "self", "torch", "nn", "F", "math", "None", "True", "False"}


def _logits_statements(forward: cst.FunctionDef | None, lm_head: str) -> list[cst.BaseStatement]:
    """The source's statements right after ``logits = self.<lm_head>(...)`` that rewrite
    ``logits`` from ``logits``, ``self`` and libraries only (softcap, scale)."""
    body = list(forward.body.body) if forward is not None else []
    at = next(
        (
            i
            for i, s in enumerate(body)
            if t.self_attr_assigned(s) is None
            and isinstance(s, cst.SimpleStatementLine)
            and isinstance(s.body[0], cst.Assign)
            and t.code(s.body[0].targets[0].target) == "logits"
            and t.call_name(s.body[0].value) == f"self.{lm_head}"
        ),
        None,
    )
    if at is None:
        return []  # nothing to carry; a post-processing the analysis saw then fails closed
    carried = []
    for s in body[at + 1 :]:
        if "logits" not in _assigned(s) or not t.root_names(s) <= _LOGITS_NAMES:
            break
        carried.append(s)
    return carried


def _assigned(node: cst.CSTNode) -> set[str]:
    names: set[str] = set()

    class _Targets(cst.CSTVisitor):
        def visit_AssignTarget(self, target: cst.AssignTarget) -> None:
            if isinstance(target.target, cst.Name):
                names.add(target.target.value)

    node.visit(_Targets())
    return names


def _head_has_bias(statements: list[cst.BaseStatement]) -> bool:
    """Whether the lm_head is built as ``ParallelLMHead(..., bias=<not False>)``."""
    found = []

    class _Head(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            if t.call_name(call) == "ParallelLMHead":
                found.extend(
                    a
                    for a in call.args
                    if a.keyword and a.keyword.value == "bias" and t.code(a.value) != "False"
                )

    for s in statements:
        s.visit(_Head())
    return bool(found)


def _scaling_head_input(tpl: cst.ClassDef, forward: cst.FunctionDef, plan) -> cst.ClassDef:
    """compute_logits first scales the hidden states as the source's ``self.<lm_head>(<expr>)``
    does (the analysis proved a constant factor): ``<expr>`` on vLLM's ``hidden_states``."""
    calls = []

    class _HeadCalls(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            if t.call_name(call) == f"self.{plan.lm_head}" and len(call.args) == 1:
                calls.append(call.args[0].value)

    forward.visit(_HeadCalls())
    roots = t.root_names(calls[0]) - {"self"} if len(calls) == 1 else set()
    if len(roots) != 1:
        raise HfrewriteError(f"{plan.architecture}: {NAME}: the lm_head's scaled input is not one expression")
    expr = t.code(t.replace_names(calls[0], {roots.pop(): "hidden_states"}))
    logits = t.find_method(tpl, "compute_logits")
    scale = t.stmts(f"hidden_states = {expr}  # as the source scales the lm_head's input\n")
    return t.set_method(tpl, t.with_body(logits, [*scale, *logits.body.body]))


def rewrite_causal_lm(cls: cst.ClassDef, ctx: PassContext) -> cst.ClassDef:
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
    init = t.find_method(tpl, "__init__")
    body = list(init.body.body)
    at = next(i for i, s in enumerate(body) if t.self_attr_assigned(s) == plan.base_model_attr) + 1
    carried = _logits_statements(t.find_method(cls, "forward"), plan.lm_head)
    if plan.logits_postprocessed and not carried:
        raise HfrewriteError(
            f"{plan.architecture}: {NAME}: the logits are post-processed, but not by "
            f"statements right after `logits = self.{plan.lm_head}(...)`"
        )
    # attributes the carried statements read (`self.logit_scale = config.logit_scale`)
    reads = set().union(*(t.self_attrs_used(s) for s in carried)) - {"config"}
    head += [s for s in source_init.body.body if t.self_attr_assigned(s) in reads and s not in head]
    body[at:at] = head
    tpl = t.set_method(tpl, t.with_body(init, body))
    if _head_has_bias(head):  # the source's lm_head has a bias: the logits add it
        logits = t.find_method(tpl, "compute_logits")
        tpl = t.set_method(
            tpl,
            t.with_body(
                logits,
                t.stmts(
                    f"return self.logits_processor(self.{plan.lm_head}, hidden_states, self.{plan.lm_head}.bias)\n"
                ),
            ),
        )
    if carried:
        logits = t.find_method(tpl, "compute_logits")
        tpl = t.set_method(
            tpl,
            t.with_body(
                logits,
                [
                    *t.stmts(
                        f"logits = self.logits_processor(self.{plan.lm_head}, hidden_states"
                        f"{f', self.{plan.lm_head}.bias' if _head_has_bias(head) else ''})\n"
                        "# the source's post-processing of the logits\nif logits is not None:\n    pass\n"
                    ),
                    t.stmt("return logits\n"),
                ],
            ),
        )
        logits = t.find_method(tpl, "compute_logits")
        guard = logits.body.body[1]
        inner = carried[0] if len(carried) == 1 else None
        if isinstance(inner, cst.If) and inner.orelse is None:  # one test: joined to the guard's
            test = t.code(inner.test)
            if isinstance(inner.test, (cst.BooleanOperation, cst.IfExp, cst.Lambda, cst.NamedExpr)):
                test = f"({test})"
            guard = guard.with_changes(test=t.expr(f"logits is not None and {test}"))
            carried = list(inner.body.body)
        logits = t.with_body(
            logits,
            [
                logits.body.body[0],
                guard.with_changes(body=guard.body.with_changes(body=carried)),
                logits.body.body[2],
            ],
        )
        tpl = t.set_method(tpl, logits)
    if plan.head_input_scaled:  # after the carried post-processing, which rebuilds compute_logits
        tpl = _scaling_head_input(tpl, t.find_method(cls, "forward"), plan)
    return tpl.with_changes(leading_lines=cls.leading_lines)


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
            "AutoWeightsLoader",
        ),
        fused=(
            FusionRow(
                plan.base_model_class,
                f"{plan.layers} -> make_layers (pipeline parallel), torch.compile",
            ),
            FusionRow(plan.architecture, "vLLM model interface (SupportsLoRA, SupportsPP)"),
            *(
                [
                    FusionRow(
                        plan.architecture,
                        "logits post-processing carried from the source into compute_logits",
                    )
                ]
                if plan.logits_postprocessed
                else []
            ),
        ),
        matches=sites.count,
    )
