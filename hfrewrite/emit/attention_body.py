"""What an attention ``forward`` does besides projecting, statement by statement: which
statements the vLLM rewrite may drop (their meaning is in the plan or vLLM's layers), which it
carries (config-switched in-place clamps), which it must refuse. Used by
``passes/vllm_attention.py``."""

from __future__ import annotations

import ast

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t

# What an attention forward may do besides projecting, for the rewrite to be faithful:
# reshape q/k/v, apply the plan's per-head norms, the rope helper, the HF cache update, the
# attention interface and the output projection. Anything else is refused (fail closed).
LAYOUT_METHODS = {"view", "transpose", "reshape", "contiguous", "flatten", "unsqueeze"}
ALLOWED_CALLS = LAYOUT_METHODS | {
    "attention_interface",
    "get_interface",
    "getattr",
}
# dropout after the output projection: the analysis proved it the identity at inference
DROPOUT_CALLS = {"dropout"}
# torch's tensor factories: free of effects; what they build (a causal mask over concrete
# lengths) reaches the output only through the attention call the analysis proved
FACTORIES = {"ones", "zeros", "full", "empty", "arange", "tril", "triu", "bool", "sqrt", "finfo"}


class _Calls(cst.CSTVisitor):
    def __init__(self) -> None:
        self.names: list[str] = []

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        self.names.append(func.attr.value if isinstance(func, cst.Attribute) else t.dotted(func) or "?")


# In-place elementwise ops on q/k/v that a config can switch on (olmoe's clip_qkv): the
# source's `if` is carried over verbatim, with q/k/v renamed to vLLM's names.
_INPLACE_ELEMENTWISE = {"clamp_", "clip_"}


def state_names(body: list[cst.BaseStatement]) -> dict[str, str]:
    """HF names of the q/k/v tensors -> "q"/"k"/"v" (`query_states = q.view(...)` ...)."""
    names = {"q": "q", "k": "k", "v": "v"}
    for statement in body:
        if isinstance(statement, cst.SimpleStatementLine) and isinstance(statement.body[0], cst.Assign):
            assign = statement.body[0]
            pairs = _tuple_pairs(assign)  # `query, key, value = q, k, v`
            if pairs:
                names.update({target: names[source] for target, source in pairs if source in names})
                continue
            sources = {names[n] for n in t.names_used(assign.value) if n in names}
            targets = [
                e.value
                for tgt in assign.targets
                for e in (
                    tgt.target.elements if isinstance(tgt.target, cst.Tuple) else [cst.Element(tgt.target)]
                )
                if isinstance(e.value, cst.Name)
            ]
            if len(sources) == 1 and len(targets) == 1:
                names[targets[0].value] = sources.pop()
    return names


def _tuple_pairs(assign: cst.Assign) -> list[tuple[str, str]]:
    """(target, source) names of ``a, b = x, y``; [] for any other assignment."""
    if len(assign.targets) != 1:
        return []
    target, value = assign.targets[0].target, assign.value
    if not (isinstance(target, cst.Tuple) and isinstance(value, cst.Tuple)):
        return []
    if len(target.elements) != len(value.elements):
        return []
    pairs = [(a.value, b.value) for a, b in zip(target.elements, value.elements)]
    if not all(isinstance(a, cst.Name) and isinstance(b, cst.Name) for a, b in pairs):
        return []
    return [(a.value, b.value) for a, b in pairs]


def carried_conditional(statement: cst.BaseStatement, states: dict[str, str]) -> cst.If | None:
    """`if <config test>: q.clamp_(...)`-style statement, renamed to q/k/v, or None."""
    if not isinstance(statement, cst.If) or statement.orelse is not None:
        return None
    if t.names_used(statement.test) & set(states):
        return None
    for line in statement.body.body:
        call = (
            line.body[0].value
            if isinstance(line, cst.SimpleStatementLine) and isinstance(line.body[0], cst.Expr)
            else None
        )
        if not (
            isinstance(call, cst.Call)
            and isinstance(call.func, cst.Attribute)
            and isinstance(call.func.value, cst.Name)
            and call.func.value.value in states
            and call.func.attr.value in _INPLACE_ELEMENTWISE
            and not (
                t.names_used(
                    cst.Module([cst.SimpleStatementLine([cst.Expr(a.value) for a in call.args])])
                    if call.args
                    else set()
                )
                & set(states)
            )
        ):
            return None

    class _Rename(cst.CSTTransformer):
        def leave_Name(self, original, updated):
            return updated.with_changes(value=states.get(updated.value, updated.value))

    return statement.visit(_Rename())


def cache_update(statement: cst.BaseStatement, params: set[str]) -> bool:
    """``if <cache> is not None: k, v = <cache>.update(...)``, ``<cache>`` a forward
    parameter (Hugging Face's KV cache): vLLM's Attention owns the cache, so it goes."""
    if not isinstance(statement, cst.If) or statement.orelse is not None:
        return False
    caches = t.root_names(statement.test) & params
    return bool(caches) and (
        all(
            isinstance(s, cst.SimpleStatementLine)
            and len(s.body) == 1
            and isinstance(s.body[0], cst.Assign)
            and isinstance(s.body[0].value, cst.Call)
            and isinstance(s.body[0].value.func, cst.Attribute)
            and t.dotted(s.body[0].value.func.value) in caches
            and s.body[0].value.func.attr.value == "update"
            for s in statement.body.body
        )
        or _tuple_cache_concat(statement.body.body, caches)
    )


def _tuple_cache_concat(body, caches: set[str]) -> bool:
    """The tuple cache of transformers 4.x era code: names read off the cache parameter
    (``past_key, past_value = layer_past[0], layer_past[1]``), then k and v each
    concatenated after them (``key = torch.cat((past_key, key), dim=1)``)."""
    past = set(caches)
    concatenated = 0
    for s in body:
        if not (
            isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 and isinstance(s.body[0], cst.Assign)
        ):
            return False
        assign = s.body[0]
        targets = {n for tgt in assign.targets for n in t.root_names(tgt.target)}
        if t.names_used(assign.value) <= past:
            past |= targets  # only reads the cache
            continue
        value = assign.value
        if not (
            isinstance(value, cst.Call)
            and t.dotted(value.func) in ("torch.cat", "cat")
            and value.args
            and isinstance(value.args[0].value, cst.Tuple | cst.List)
            and len(value.args[0].value.elements) == 2
        ):
            return False
        first, second = (e.value for e in value.args[0].value.elements)
        if not (t.names_used(first) <= past and t.dotted(second) in targets and len(targets) == 1):
            return False
        concatenated += 1
    return concatenated == 2


# Size arithmetic on the operands of attention written by hand (MPT slicing its ALiBi bias to
# the key length): it reads shapes only, and the scores it shapes are what the analysis proved
SIZE_CALLS = {"len", "max", "min", "size", "dim", "int"}


# dtype casts (XGLM's softmax upcast in float16, a branch float32 never takes): precision only
_CASTS = {"to", "float", "half"}


def attention_branches(statement: cst.BaseStatement, allowed_calls: set[str]) -> bool:
    """``if <not a config switch>: ... else: ...`` whose branches only make the calls the
    plan accounts for, and casts (shape checks that raise included): the source picking its causal
    attention by shapes or cache, or shaping the bias it adds (prefill traced and proven,
    decode checked by convert-time validation); vLLM's replaces both."""
    if not isinstance(statement, cst.If) or t.root_names(statement.test) & _SWITCH_NAMES - {"None"}:
        return False
    branches = [statement.body.body]
    if isinstance(statement.orelse, cst.Else):
        branches.append(statement.orelse.body.body)
    elif statement.orelse is not None:
        return False  # elif chains: not this shape
    return all(
        raises_only(s) or not unrecognised(s, allowed_calls | SIZE_CALLS | _CASTS)
        for body in branches
        for s in body
    )


def reads_dropped_cache(statement: cst.BaseStatement, caches: set[str], allowed_calls: set[str]) -> bool:
    """``n = s if <cache> is None else s + <cache>.get_seq_length()``: lengths read off
    Hugging Face's cache parameter, which vLLM does not pass (its Attention owns the cache)."""
    if not isinstance(statement, cst.SimpleStatementLine) or not t.root_names(statement) & caches:
        return False
    calls = [
        n
        for n in t.walk(statement)
        if isinstance(n, cst.Call)
        and not (
            isinstance(n.func, cst.Attribute)
            and n.func.attr.value == "get_seq_length"
            and t.root_names(n.func.value) <= caches
        )
    ]
    return all(
        not unrecognised(cst.SimpleStatementLine([cst.Expr(c)]), allowed_calls | SIZE_CALLS) for c in calls
    )


def unrecognised(statement: cst.BaseStatement, allowed_calls: set[str]) -> bool:
    """True for a statement the vLLM rewrite would silently drop the meaning of."""
    if isinstance(statement, cst.If):
        return True  # the caller sorts out the ifs it knows
    if not isinstance(statement, cst.SimpleStatementLine):
        return True
    calls = _Calls()
    statement.visit(calls)
    return any(c not in allowed_calls for c in calls.names)


# What a config switch may read: the module's own attributes and constants.
_SWITCH_NAMES = {"self", "config", "None", "True", "False"}


def config_switch(statement: cst.BaseStatement) -> cst.BaseExpression | None:
    """The test of ``if <self/config test>: ...`` (no else), else None."""
    if (
        isinstance(statement, cst.If)
        and statement.orelse is None
        and t.root_names(statement.test) - _own_attribute_tests(statement.test) <= _SWITCH_NAMES
    ):
        return statement.test
    return None


def _own_attribute_tests(test: cst.BaseExpression) -> set[str]:
    """``{"hasattr"}`` where every call of it in ``test`` asks whether the module holds a
    named attribute (Llama-4's ``hasattr(self, "qk_norm")``: fixed when it is built, like
    ``self.<flag>``), else the empty set."""
    calls = m.findall(test, m.Call(func=m.Name("hasattr")))
    own = m.Call(func=m.Name("hasattr"), args=[m.Arg(m.Name("self")), m.Arg(m.SimpleString())])
    return {"hasattr"} if calls and all(m.matches(c, own) for c in calls) else set()


def guards_rope(statement: cst.If, allowed_calls: set[str], states: dict[str, str]) -> bool:
    """The body only re-assigns q/k states through the allowed (rope and layout) calls:
    the position-dependent region the analysis proved is the rope, under a condition."""
    assigned = _assigned_names(statement)
    read = set().union(set(), *(t.root_names(s) for s in statement.body.body))
    return (
        all(not unrecognised(s, allowed_calls) for s in statement.body.body)
        and bool({states.get(name) for name in assigned} & {"q", "k"})
        and bool(read - set(states) - assigned - {"self"})  # the position inputs (cos, sin)
    )


def _assigned_names(statement: cst.If) -> set[str]:
    """The names the ``if`` body's plain assignments bind (their roots)."""
    return {
        name
        for s in statement.body.body
        if isinstance(s, cst.SimpleStatementLine)
        for small in s.body
        if isinstance(small, cst.Assign)
        for target in small.targets
        for name in t.root_names(target.target)
    }


def taken_layout(
    statement: cst.BaseStatement,
    true_switches: set[str],
    init_exprs: dict[str, str],
    allowed_calls: set[str],
    states: dict[str, str],
) -> bool:
    """``if <config switch the trace took>: ... else: ...`` whose taken body only lays out
    the q/k/v states through the allowed calls (ChatGLM3's multi-query head split): what the
    analysis accounted for; ``config_guards`` refuses configs that take the other branch."""
    if not isinstance(statement, cst.If) or isinstance(statement.orelse, cst.If):
        return False
    try:
        expr = t.config_test(t.code(statement.test), init_exprs)
    except ValueError:
        return False
    if ast.dump(ast.parse(expr, mode="eval").body) not in true_switches:
        return False
    assigned = _assigned_names(statement)
    return all(not unrecognised(s, allowed_calls) for s in statement.body.body) and bool(
        {states.get(name) for name in assigned} & {"q", "k", "v"}
    )


# Python's own helpers a block over the rope's position inputs may use besides the allowed calls
_POSITION_BLOCK_CALLS = {"enumerate", "append", "len", "range", "zip", "cat"}


def position_block(
    statement: cst.BaseStatement,
    params: set[str],
    states: dict[str, str],
    allowed_calls: set[str],
    later: list[cst.BaseStatement],
) -> bool:
    """``if <test on forward parameters>: ...`` that only turns q and k by the position
    inputs (Qwen's ``if rotary_pos_emb_list is not None:``, one branch per list length):
    the traced branch is the rope the analysis proved on the values; the parameters it
    tests are gone from the vLLM forward (``positions`` replaces them), so every branch is.
    Its other names stay local (not read after it); it never assigns v."""
    if not isinstance(statement, cst.If):
        return False
    tested = t.root_names(statement.test) - _SWITCH_NAMES
    if not tested or not tested <= params - set(states):
        return False
    assigned = _assigned_names(statement)
    if any(states.get(name) not in (None, "q", "k") for name in assigned):
        return False
    if not {states.get(name) for name in assigned} & {"q", "k"}:
        return False
    local = {name for name in assigned if name not in states}
    if any(local & t.names_used(s) for s in later):
        return False
    calls = _Calls()
    statement.visit(calls)
    return all(c in allowed_calls | _POSITION_BLOCK_CALLS for c in calls.names)


def _assigned_names(node: cst.CSTNode) -> set[str]:
    names: set[str] = set()

    class Targets(cst.CSTVisitor):
        def visit_AssignTarget(self, target: cst.AssignTarget) -> None:
            names.update(t.root_names(target.target))

        def visit_For(self, loop: cst.For) -> None:
            names.update(t.root_names(loop.target))

    node.visit(Targets())
    return names


def dead_for_config(
    statement: cst.BaseStatement, false_switches: set[str], init_exprs: dict[str, str]
) -> bool:
    """``if <...> and <config switch> and <...>:`` (no else) whose switch the analysis found
    false on the traced config (``false_switches``: ``ast.dump`` of the config form): never
    taken for it; ``config_guards`` refuses the configs that turn the switch on."""
    if not isinstance(statement, cst.If) or statement.orelse is not None:
        return False
    test = statement.test
    operands = [test]
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        operands = _and_operands(test)
    for operand in operands:
        try:
            expr = t.config_test(t.code(operand), init_exprs)
        except ValueError:
            continue
        if ast.dump(ast.parse(expr, mode="eval").body) in false_switches:
            return True
    return False


def _and_operands(test: cst.BaseExpression) -> list[cst.BaseExpression]:
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return [*_and_operands(test.left), *_and_operands(test.right)]
    return [test]


def flag_block(
    statement: cst.BaseStatement, dropped: set[str], constants: set[str], states: dict[str, str]
) -> bool:
    """``if <test>: ... [else: ...]`` whose test reads only forward parameters the vLLM
    forward no longer has (``output_attentions``, ``attention_mask``, the KV cache) and the
    module's own top-level constants (``SUPPORT_TORCH2``): vLLM's calling convention is
    the traced one, so the traced branch is the one that runs, and what it computed on the
    q/k/v and output paths is what the analysis proved (layout, rope, the attention)."""
    if not isinstance(statement, cst.If):
        return False
    names = t.root_names(statement.test) - {"None", "True", "False"}
    return bool(names & dropped) and names <= (dropped | constants) - set(states) - {"self"}


def _literal(node: cst.BaseExpression) -> bool:
    return (
        isinstance(node, cst.Name)
        and node.value in ("None", "True", "False")
        or isinstance(node, (cst.Integer, cst.Float, cst.SimpleString))
    )


def convention_locals(forward: cst.FunctionDef) -> set[str]:
    """The forward's parameters vLLM does not pass (all but ``self`` and the hidden states),
    and the locals computed from them alone (``is_cross_attention = encoder_hidden_states is
    not None``) or assigned only under a test of them (``is_updated``): values fixed by the
    traced calling convention, whatever the config."""
    params = [p.name.value for p in (*forward.params.params, *forward.params.kwonly_params)]
    dropped = set(params[2:]) | {p.name.value for p in forward.params.kwonly_params}
    elsewhere: set[str] = set()  # locals also bound by the forward's own computation
    for statement in forward.body.body:
        small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        bound = _bound_names(statement)
        # it never reads the hidden states or what the forward computed from them
        pure = not (t.root_names(statement) & (elsewhere | set(params[1:2])))
        if (
            pure
            and isinstance(small, cst.Assign)
            and all(isinstance(x.target, cst.Name) for x in small.targets)
        ):
            # (a literal too: BioGPT's `is_updated = False`, set again under a cache test)
            reads = t.root_names(small.value) - {"None", "True", "False", "isinstance", "self"}
            if reads <= dropped and (reads or _literal(small.value)):
                dropped |= bound
                continue
        elif pure and isinstance(statement, cst.If) and _on_convention(statement.test, dropped):
            dropped |= bound
            continue
        elsewhere |= bound
    return dropped - (elsewhere - set(params))


def _bound_names(node: cst.CSTNode) -> set[str]:
    """Local names ``node`` binds (``a, b = ...``), not attributes or items it assigns."""
    names: set[str] = set()

    class Targets(cst.CSTVisitor):
        def visit_AssignTarget(self, target: cst.AssignTarget) -> None:
            node = target.target
            targets = [e.value for e in node.elements] if isinstance(node, cst.Tuple) else [node]
            names.update(x.value for x in targets if isinstance(x, cst.Name))

    node.visit(Targets())
    return names


def _on_convention(test: cst.BaseExpression, convention: set[str]) -> bool:
    names = t.root_names(test) - {"None", "True", "False", "isinstance"}
    return bool(names) and names <= convention


def traced_branch(statement: cst.If, convention: set[str], ran: set[str]) -> bool | None:
    """Which branch of ``if <test on the calling convention>: A else: B`` the trace ran
    (True: ``A``): the one whose own lines (those the other lacks) made nodes, when exactly
    one did; None otherwise."""
    if not _on_convention(statement.test, convention) or isinstance(statement.orelse, cst.If):
        return None
    other = list(statement.orelse.body.body) if statement.orelse is not None else []
    lines = [_lines(list(statement.body.body)), _lines(other)]
    own = [lines[0] - lines[1], lines[1] - lines[0]]
    hits = [bool(x & ran) for x in own]
    if hits == [True, False]:
        return True
    if hits == [False, True] and other:
        return False
    return None


def _lines(statements: list) -> set[str]:
    return {" ".join(line.split()) for s in statements for line in t.code(s).splitlines() if line.strip()}


def raises_only(statement: cst.BaseStatement) -> bool:
    """``if <check>: raise ...`` (transformers 4.x's shape checks): the traced run passed
    it; dropping it removes an error path, never changes a value."""
    return (
        isinstance(statement, cst.If)
        and statement.orelse is None
        and all(
            isinstance(s, cst.SimpleStatementLine) and all(isinstance(x, cst.Raise) for x in s.body)
            for s in statement.body.body
        )
    )


class AttentionCallKwargs(cst.CSTVisitor):
    """The keyword arguments of the source's call `attention_interface(self, q, k, v, mask,
    **kw)` (``scaling=``, ``sliding_window=``...); None where there is no such call."""

    def __init__(self) -> None:
        self.kwargs: dict[str, cst.BaseExpression] | None = None

    def visit_Call(self, node: cst.Call) -> None:
        if t.dotted(node.func) == "attention_interface":
            self.kwargs = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
