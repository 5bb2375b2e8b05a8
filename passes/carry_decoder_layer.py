"""Carry a decoder layer's forward from the source, adapted to vLLM's calling convention.

Matches the decoder layer of a plan whose layer is not a sequence of fusable pre-norm
residual blocks (``DecoderLayerPlan.fused`` false: post or sandwich norms, parallel
attention and MLP, dropouts, config switches such as ``use_parallel_residual``).

Emits the source's own ``forward`` body, so every residual, norm and config branch stays
as written, with these changes:

* the signature becomes ``forward(self, positions, hidden_states)``;
* the attention call becomes ``self.self_attn(positions=positions, hidden_states=x)``,
  ``x`` being the argument the source binds to the attention forward's first parameter
  (plus ``residual=r`` when the attention adds the residual itself: BLOOM);
  vLLM's attention returns one tensor, so ``out, _ = self.self_attn(...)`` becomes
  ``out = ...``, ``self.self_attn(...)[0]`` becomes the call, and ``outputs =
  self.self_attn(...)`` (read as ``outputs[0]``) a one-tuple (an attention the trace saw
  return its tensor alone, as custom code's often does, keeps how its result is used);
* dropped inputs the analysis proved free to take their literal defaults
  (``DecoderLayerPlan.free_defaults``: ``use_cache``, ``layer_past=None``) are read as those
  defaults, and the ``if`` statements this makes constant reduce to the branch they take;
* a layer the trace saw return a tuple (transformers 4.x) returns its first element;
* a hybrid layer's other mixer (``ModelPlan.mixer``: Granite-4.0-H's Mamba-2) is called with
  the hidden states alone (``self.mamba(hidden_states)``), vLLM's layer keeping its own state;
  an attention-free model's layer (Mamba-2 layers alone) has no attention call to rewrite,
  nor has the mixer's own class beside carried attention layers (OLMo-hybrid's gated delta
  net layers, carried so that every layer returns its hidden states alone);
* an ``if`` on a config switch (``ModelPlan.forward_switches``: one value on every traced
  layer) whose other branch reads inputs vLLM does not give (granite-4.0-micro's Mamba call,
  every layer attending) becomes the branch taken, and ``__init__`` builds only what that
  branch runs, refusing first the configs that would take the other;
* nothing else may read the dropped Hugging Face inputs (masks, cache, position ids).

A layer that reaches its attention through wrapper modules (dbrx's ``norm_attn_norm``,
norms around ``attn``) has each wrapper's forward carried the same way, its return as the
source has it; a wrapper that returns its attention call as it is (GPT-Neo's
``GPTNeoAttention``) returns vLLM's tensor, and its caller takes that as it took the tuple.

Preconditions (else refused with the reason): the attention submodule is called exactly
once; the call's result is unpacked as above; the dropped parameters are not read
anywhere else in the body.
"""

from __future__ import annotations

import ast

import libcst as cst
import libcst.matchers as m

from hfrewrite.analyze.optional_parts import optional_tests
from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.dropped_defaults import bound_to_defaults
from hfrewrite.emit.given_residual import residual_param
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites
from hfrewrite.emit.returned_parameters import read_off, returned_at, unpacked
from hfrewrite.emit.taken_init import with_traced_branches
from hfrewrite.errors import HfrewriteError

NAME = "carry_decoder_layer"
_POSITIONS = "vllm_positions__"


def _first_param(fn: cst.FunctionDef) -> str:
    params = [p.name.value for p in fn.params.params if p.name.value != "self"]
    return params[0] if params else ""


def _bound_first(call: cst.Call, first: str) -> cst.BaseExpression | None:
    """The argument of ``call`` bound to the callee's first parameter ``first``."""
    positional = [a for a in call.args if a.keyword is None and not a.star]
    if positional:
        return positional[0].value
    return next((a.value for a in call.args if a.keyword and a.keyword.value == first), None)


class _AttentionCall(cst.CSTTransformer):
    """Rewrites ``self.<attn>(...)`` and how its (tuple) result is taken."""

    def __init__(
        self,
        attr: str,
        first: str,
        cls: str,
        returns_tuple: bool,
        residual: tuple | None = None,
        as_list: bool = False,
        returned: dict[int, str] | None = None,
    ) -> None:
        self.func, self.first, self.cls = f"self.{attr}", first, cls
        self.returns_tuple, self.as_list = returns_tuple, as_list
        self.residual = residual  # (parameter, the callee's forward): the tensor it adds
        self.returned = returned or {}  # tuple index -> the callee's parameter it returns there
        self.count = 0
        self.extra: set[str] = set()

    def leave_Call(self, original, updated):
        if not self.returns_tuple and t.call_name(updated) == self.func:
            return self._call(updated)  # the source's attention returns its output tensor alone
        return updated

    def _call(self, call: cst.Call) -> cst.Call:
        x = _bound_first(call, self.first)
        if x is None:
            raise HfrewriteError(f"{self.cls}: {NAME}: {self.func}(...) passes no hidden states")
        self.count += 1
        given = ""
        if self.residual is not None:  # the attention adds this argument to its output
            param, callee = self.residual
            at = t.bound_arg(call, callee, True, param)  # a bound method: self left out
            if at is None or at < 0:
                raise HfrewriteError(f"{self.cls}: {NAME}: {self.func}(...) passes no {param}")
            given = f", {param}={t.code(call.args[at].value)}"
        # vLLM's positions under a name of their own until the dropped inputs are checked
        return t.expr(f"{self.func}(positions={_POSITIONS}, hidden_states={t.code(x)}{given})")

    def leave_Return(self, original, updated):
        if self.returns_tuple and t.call_name(original.value) == self.func:
            # a wrapper handing the attention's result up as it is (GPT-Neo's GPTNeoAttention):
            # vLLM's tensor, which its caller then takes as it took the tuple's first element
            return updated.with_changes(value=self._call(updated.value))
        return updated

    def leave_Assign(self, original, updated):
        value = updated.value
        target = updated.targets[0].target if len(updated.targets) == 1 else None
        if self.returns_tuple and t.call_name(value) == self.func and isinstance(target, cst.Tuple):
            rest = [e.value for e in target.elements[1:]]
            if not all(isinstance(r, cst.Name) for r in rest):
                raise HfrewriteError(f"{self.cls}: {NAME}: the attention's extra outputs are unpacked")
            params = [r.value for i, r in enumerate(rest, 1) if i in self.returned]  # read off the block
            self.extra |= {r.value for r in rest} - {"_", *params}  # (attention weights) must go unread
            return unpacked(updated, self.returned, self.func, self._call(value))
        if self.returns_tuple and t.call_name(original.value) == self.func and isinstance(target, cst.Name):
            # `outputs = self.attn(...)` read as `outputs[0]`, `outputs[1:]`: a one-tuple (no extras)
            one = (cst.List if self.as_list else cst.Tuple)([cst.Element(self._call(value))])
            return updated.with_changes(value=one)
        return updated

    def leave_Subscript(self, original, updated):
        index = updated.slice[0].slice if len(updated.slice) == 1 else None
        if (
            self.returns_tuple
            and t.call_name(updated.value) == self.func
            and isinstance(index, cst.Index)
            and isinstance(index.value, cst.Integer)
            and index.value.value == "0"
        ):
            return self._call(updated.value)
        return updated


class _MixerCall(cst.CSTTransformer):
    """``self.<mixer>(hidden_states=x, cache_params=..., ...)`` -> ``self.<mixer>(x)``: a hybrid
    model's other mixer (hybrid_mixer builds it as vLLM's layer, which keeps its own state)."""

    def __init__(self, attr: str, first: str, cls: str) -> None:
        self.func, self.first, self.cls, self.count = f"self.{attr}", first, cls, 0

    def leave_Call(self, original, updated):
        if t.call_name(updated) != self.func:
            return updated
        x = _bound_first(updated, self.first)
        if x is None:
            raise HfrewriteError(f"{self.cls}: {NAME}: {self.func}(...) passes no hidden states")
        self.count += 1
        return t.expr(f"{self.func}({t.code(x)})")


def _mixer_called(body: cst.IndentedBlock, mixer: tuple[str, str] | None, cls: str) -> cst.IndentedBlock:
    """``body`` with the hybrid layer's other mixer, called once, given the hidden states alone."""
    if mixer is None:
        return body
    mixing = _MixerCall(*mixer, cls)
    body = body.visit(mixing)
    if mixing.count != 1:
        raise HfrewriteError(f"{cls}: {NAME}: self.{mixer[0]} is called {mixing.count} times, expected once")
    return body


def _count_calls(node: cst.CSTNode, func: str) -> int:
    found = []

    class _Calls(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            found.append(t.call_name(call) == func)

    node.visit(_Calls())
    return sum(found)


def carry_forward(
    layer: cst.ClassDef,
    attn: str,
    attn_first: str,
    returns_tuple: bool = True,
    wrapper: bool = False,
    layer_returns_tuple: bool = False,
    residual: tuple | None = None,
    free_defaults: tuple[str, ...] = (),
    as_list: bool = False,
    mixer: tuple[str, str] | None = None,
    switches: dict[str, bool] | None = None,
    pruned: list | None = None,
    returned: dict[int, str] | None = None,
) -> cst.ClassDef:
    """``layer`` with its forward taking vLLM's arguments and calling ``self.<attn>`` so;
    a ``wrapper`` (a module between the layer and its attention) keeps its return type; a
    layer the trace saw return a tuple returns its first element; a hybrid layer's other
    ``mixer`` (its attribute, its forward's first parameter) is given the hidden states alone;
    ``switches`` ({ast.dump of a config test: its value on every traced layer}) decide the
    branches that read the dropped inputs, each (test, value) it decided added to ``pruned``;
    ``returned``: {tuple index: the attention's parameter its forward returns there}."""
    name = layer.name.value
    forward = t.find_method(layer, "forward")
    hidden = _first_param(forward)
    dropped = {p.name.value for p in (*forward.params.params, *forward.params.kwonly_params)} - {
        "self",
        hidden,
    }
    if forward.params.star_kwarg is not None:
        dropped.add(forward.params.star_kwarg.name.value)
    body, defaulted = bound_to_defaults(forward, dropped & set(free_defaults))
    dropped -= defaulted
    forward = forward.with_changes(body=body)
    rewriter = _AttentionCall(attn, attn_first, name, returns_tuple, residual, as_list, returned)
    body = _attention_called(forward.body, rewriter) if attn else forward.body  # (attention-free: none)
    body = _mixer_called(body, mixer, name)
    # branches no traced layer took that read what vLLM does not give
    exprs = t.init_exprs(layer) if t.find_method(layer, "__init__") else {}
    body = body.visit(untaken := _UntakenBranches(switches or {}, exprs, t.code(_init(layer)), dropped))
    unpacked = _without_output_tuple(body, dropped | rewriter.extra)
    if unpacked is body and layer_returns_tuple:
        unpacked = body.visit(_FirstReturned())  # `return outputs` of `(hidden_states, ...)`
    body = unpacked
    still = sorted(t.root_names(body) & (dropped | rewriter.extra))
    if still:
        raise HfrewriteError(
            f"{name}: {NAME}: the forward reads {', '.join(still)}, which vLLM does not give"
        )
    body = t.rename_locals(forward.with_changes(body=body), {_POSITIONS: "positions"}).body
    sig = t.stmt(
        f"def forward(self, positions: torch.Tensor, {hidden}: torch.Tensor) -> torch.Tensor:\n    pass\n"
    )
    forward = forward.with_changes(
        params=sig.params,
        returns=forward.returns if wrapper else sig.returns,
        body=body,
        whitespace_before_params=sig.whitespace_before_params,
    )
    return _init_taken(t.set_method(layer, forward), untaken.taken, pruned)


def _init_taken(layer: cst.ClassDef, taken: list, pruned: list | None) -> cst.ClassDef:
    """``layer`` whose ``__init__`` builds only what the kept branches run (config switches
    ``taken``, added to ``pruned``), refusing first the configs that take another."""
    if not taken:
        return layer
    if pruned is not None:
        pruned += taken
    return with_traced_branches(layer, taken, t.init_exprs(layer))


def _pruned_rows(owner: str, pruned: list) -> list[FusionRow]:
    return [
        FusionRow(
            owner, f"config switch `{test}`: the branch every traced layer took kept, the other refused"
        )
        for test, _ in dict.fromkeys(pruned)
    ]


def _attention_called(body: cst.BaseSuite, rewriter: _AttentionCall) -> cst.BaseSuite:
    """``body`` calling its attention (called once) in vLLM's convention."""
    calls = _count_calls(body, rewriter.func)
    if calls != 1:
        raise HfrewriteError(
            f"{rewriter.cls}: {NAME}: {rewriter.func} is called {calls} times, expected once"
        )
    body = body.visit(rewriter)
    if rewriter.count != 1:
        raise HfrewriteError(
            f"{rewriter.cls}: {NAME}: the attention result is not taken as `out, _ = ...` or `(...)[0]`"
        )
    return body


def _init(layer: cst.ClassDef) -> cst.CSTNode:
    return t.find_method(layer, "__init__") or cst.SimpleStatementLine([cst.Pass()])


class _UntakenBranches(cst.CSTTransformer):
    """``if <config switch>: A else: B`` -> the branch every traced layer took, where the other
    reads inputs vLLM does not give (Granite-4.0's Mamba call, ``**kwargs`` and the cache,
    in a model whose layers all attend); ``taken`` lists them for ``__init__`` to take too."""

    def __init__(
        self, switches: dict[str, bool], exprs: dict[str, str], init: str, dropped: set[str]
    ) -> None:
        self.switches, self.exprs, self.dropped = switches, exprs, dropped
        self.optional = optional_tests(init)  # `self.mamba is not None` as its config test
        self.taken: list[tuple[str, bool]] = []  # (config test, traced value) of each pruned

    def leave_If(self, original: cst.If, updated: cst.If):
        if isinstance(updated.orelse, cst.If):
            return updated  # elif chains: left as written
        try:
            test = t.config_test(self.optional(t.code(updated.test)), self.exprs)
        except ValueError:
            return updated
        value = self.switches.get(ast.dump(ast.parse(test, mode="eval").body))
        if value is None:
            return updated
        taken = updated.body if value else updated.orelse
        untaken = updated.orelse if value else updated.body
        if untaken is None or not t.root_names(untaken) & self.dropped:
            return updated
        self.taken.append((test, value))
        body = list(taken.body.body if isinstance(taken, cst.Else) else (taken.body if taken else ()))
        return cst.FlattenSentinel(body) if body else cst.RemoveFromParent()


class _FirstReturned(cst.CSTTransformer):
    """``return x`` -> ``return x[0]``, ``return a, b`` -> ``return a``, in the forward itself
    (not in nested functions)."""

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def leave_Return(self, original: cst.Return, updated: cst.Return) -> cst.Return:
        if updated.value is None:
            return updated
        value = updated.value
        if isinstance(value, cst.Tuple) and value.elements:  # `return hidden_states, weights`
            return updated.with_changes(value=value.elements[0].value)
        bare = isinstance(value, cst.Name | cst.Attribute | cst.Subscript | cst.Call)
        return updated.with_changes(value=t.expr(f"{t.code(value)}[0]" if bare else f"({t.code(value)})[0]"))


def _returns_call(cls: cst.ClassDef, func: str) -> bool:
    """``cls.forward`` ends by returning ``func(...)`` as it is, and calls it nowhere else."""
    body = t.find_method(cls, "forward").body.body
    last = body[-1] if body else None
    ret = last.body[0] if isinstance(last, cst.SimpleStatementLine) else None
    return (
        isinstance(ret, cst.Return)
        and t.call_name(ret.value) == func
        and _count_calls(cst.Module(list(body)), func) == 1
    )


def _without_output_tuple(body: cst.IndentedBlock, dropped: set[str]) -> cst.IndentedBlock:
    """transformers 4.x's layer protocol as vLLM's: ``outputs = (hidden_states,)``, then
    ``if output_attentions: outputs += (weights,)`` / ``if use_cache: ...`` on inputs vLLM
    does not give, then ``return outputs``: the layer returns ``hidden_states``."""
    stmts = list(body.body)
    last = stmts[-1] if stmts else None
    ret = last.body[0] if isinstance(last, cst.SimpleStatementLine) else None
    if not (isinstance(ret, cst.Return) and isinstance(ret.value, cst.Name)):
        return body
    name = ret.value.value
    kept, first = [], None
    for s in stmts[:-1]:
        one = s.body[0] if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 else None
        if isinstance(one, cst.Assign) and m.matches(one.targets[0].target, m.Name(name)) and first is None:
            value = one.value
            if not (isinstance(value, cst.Tuple) and len(value.elements) == 1):
                return body
            first = value.elements[0].value
            continue
        if name in t.names_used(s):
            if not _appends_dropped(s, name, dropped):
                return body
            continue
        kept.append(s)
    if first is None:
        return body
    return body.with_changes(body=[*kept, last.with_changes(body=[ret.with_changes(value=first)])])


def _appends_dropped(statement: cst.BaseStatement, name: str, dropped: set[str]) -> bool:
    """``if <test on dropped inputs>: <name> += (<dropped values>,)``."""
    if not (isinstance(statement, cst.If) and statement.orelse is None):
        return False
    if not t.root_names(statement.test) <= dropped:
        return False
    for s in statement.body.body:
        one = s.body[0] if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 else None
        if not (isinstance(one, cst.AugAssign) and m.matches(one.target, m.Name(name))):
            return False
        if not t.root_names(one.value) <= dropped:
            return False
    return True


def _mixer_apart(plan) -> bool:
    """Whether the attention layers' forward calls a mixer of its own (not where the mixer's
    layers are a class of their own, nor where one child holds attention or the mixer by
    layer, MiniMax's: hybrid_mixer chooses the call by the child's class)."""
    return plan.mixer_layer is None and not plan.mixer_shares_child


def _mixer(module: cst.Module, plan) -> tuple[str, str] | None:
    """A hybrid layer's other mixer: its attribute and its forward's first parameter."""
    if plan.mixer is None:
        return None
    return plan.mixer.attr, _first_param(
        t.find_method(t.find_class(module, plan.mixer.module_class), "forward")
    )


def _switches(plan, layer) -> dict[str, bool]:
    return {
        ast.dump(ast.parse(test, mode="eval").body): value
        for cls, test, value in plan.forward_switches
        if cls == layer.module_class
    }


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    plan = ctx.plan
    if plan.decoder_layer.fused:
        return PassResult(module=module)
    result = _carried(module, plan)
    own = plan.mixer_layer  # the mixer's layers, a class of their own (OLMo-hybrid's): carried too
    if own is None:
        return result
    more = _attention_free(result.module, plan, _switches(plan, own), own)
    return PassResult(
        module=more.module, fused=result.fused + more.fused, matches=result.matches + more.matches
    )


def _carried(module: cst.Module, plan) -> PassResult:
    """The attention layers' class carried (the mixer's too where they are one class)."""
    layer = plan.decoder_layer
    switches = _switches(plan, layer)
    if plan.attention is None:  # an attention-free model's layer (Granite-4.0-H's, Mamba-2 only)
        return _attention_free(module, plan, switches, layer)
    # the layer calls its attention directly, or through wrappers (dbrx's norm_attn_norm)
    owners = [layer.module_class, *layer.attention_wrappers]
    callees = [*layer.attention_wrappers, plan.attention.module_class]
    attrs = layer.attention_block.split(".")
    if len(attrs) != len(owners):
        raise HfrewriteError(
            f"{layer.module_class}: {NAME}: {layer.attention_block} is not reached by its wrappers"
        )
    sites, rows, pruned = Sites(), [], []
    # a wrapper returning its attention call as it is returns what the attention returns
    handing_up = [_returns_call(t.find_class(module, w), f"self.{a}") for w, a in zip(callees, attrs[1:])]
    for i, (owner, callee, attr) in enumerate(zip(owners, callees, attrs)):
        last = i == len(owners) - 1
        tuple_result = layer.attention_returns_tuple and all(handing_up[i:])
        callee_forward = t.find_method(t.find_class(module, callee), "forward")
        residual, returned = None, returned_at(callee_forward, plan.attention, callee) if last else {}
        if last and getattr(plan.attention, "adds_residual", False):  # (MLA never does)
            param = residual_param(callee_forward, plan.attention.o.attr, callee)
            residual = (param, callee_forward)
        carried = carry_forward(
            t.find_class(module, owner),
            attr,
            _first_param(callee_forward),
            tuple_result,  # a wrapper's result is the source's, unless it hands the attention's up
            wrapper=i > 0,
            layer_returns_tuple=i == 0 and layer.returns_tuple,
            residual=residual,
            free_defaults=layer.free_defaults if i == 0 else (),
            as_list=last and layer.attention_returns_list,
            mixer=_mixer(module, plan) if i == 0 and _mixer_apart(plan) else None,
            switches=switches if i == 0 else None,
            pruned=pruned,
            returned=returned,
        )
        module = sites.replace_class(module, owner, carried)
        what = ("residuals and norms as written" if i == 0 else f"wraps {callee}") + read_off(returned, attr)
        rows.append(FusionRow(owner, f"forward carried from the source ({what})"))
    rows += _pruned_rows(layer.module_class, pruned)
    return PassResult(module=module, fused=tuple(rows), matches=sites.count)


def _attention_free(module: cst.Module, plan, switches: dict[str, bool], layer) -> PassResult:
    """The carried forward of a layer without attention (an attention-free model's, or a
    hybrid's mixer layers of a class of their own): its mixer called alone."""
    pruned = []
    carried = carry_forward(
        t.find_class(module, layer.module_class),
        "",
        "",
        layer_returns_tuple=layer.returns_tuple,
        free_defaults=layer.free_defaults,
        mixer=_mixer(module, plan),
        switches=switches,
        pruned=pruned,
    )
    sites = Sites()
    module = sites.replace_class(module, layer.module_class, carried)
    row = FusionRow(layer.module_class, "forward carried from the source (residuals and norms as written)")
    return PassResult(
        module=module, fused=(row, *_pruned_rows(layer.module_class, pruned)), matches=sites.count
    )
