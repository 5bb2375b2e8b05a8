"""Use vLLM's ``RMSNorm`` and fold the residual adds of a decoder layer into it.

Matches the RMSNorm class of the plan (fx: ``weight * x * rsqrt(mean(x^2) + eps)``, or
``(1 + weight) * ...``) built as ``Norm(size, eps=...)``, and a decoder layer whose forward is
a sequence of pre-norm residual blocks ``h = residual + block(norm(h))``.

Emits ``RMSNorm(size, eps=...)`` (``GemmaRMSNorm`` for the ``1 + weight`` form) at every
construction site, and the decoder-layer forward of vLLM's ``llama.py``, where each norm
returns ``(normed, residual)`` and performs the previous block's residual add::

    if residual is None:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
    else:
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
    hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
    hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
    hidden_states = self.mlp(hidden_states)
    return hidden_states, residual

Comments above the source's block calls (``# Self Attention``) are kept.

Without a proven norm (``plan.norm`` None) nothing changes; without fusable blocks (a
carried layer, ``carry_decoder_layer``) only the norm classes are replaced.

A norm class built from the config alone (``Norm(config)``, ERNIE-4.5) becomes
``RMSNorm(config.<size>, eps=config.<eps>)`` with the fields the analysis found by value.

A norm class chosen in ``__init__`` by a config test (``Func = RMSNorm if config.rmsnorm
else LayerNorm``, ChatGLM3) is inlined as the traced class, the test guarded
(``hfrewrite/emit/norm_aliases.py``); torch's factory keywords (``device=``, ``dtype=``) are
left to vLLM.

Preconditions: the norm class's ``__init__`` takes ``(size, eps)`` (and torch's factory
keywords), or only the config with its fields proven; each block and norm of the plan is
called in the source forward.
"""

from __future__ import annotations

import libcst as cst

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.norm_aliases import inline_norm_aliases
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult
from hfrewrite.errors import HfrewriteError

NAME = "fused_residual_norm"


class _RenameCalls(cst.CSTTransformer):
    """``Old(dim=..., eps=...)`` -> ``New(hidden_size=..., eps=...)``: keywords follow the
    source's ``__init__`` parameter names onto vLLM's (``params``: source -> vLLM)."""

    def __init__(self, old: str, new: str, params: dict[str, str]) -> None:
        self.old, self.new, self.params, self.count = old, new, params, 0

    def leave_Call(self, original, updated):
        if t.dotted(updated.func) == self.old:
            self.count += 1
            args = [
                a.with_changes(keyword=cst.Name(self.params.get(a.keyword.value, a.keyword.value)))
                if a.keyword
                else a
                for i, a in enumerate(updated.args)
                if (a.keyword.value not in FACTORY_KWARGS if a.keyword else i < 2)  # vLLM places them
            ]
            if len(args) < len(updated.args):  # what was left of the dropped ones' commas
                args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            return updated.with_changes(func=cst.Name(self.new), args=args)
        return updated


# torch's factory keywords (``nn.LayerNorm(..., device=None, dtype=None)``): where the
# weight is made and in which dtype, which vLLM decides for its own layers
FACTORY_KWARGS = ("device", "dtype")


def _factory_extras(init: cst.FunctionDef) -> bool:
    """``__init__(self, size, eps=..., device=None, dtype=None, **kwargs)``: only torch's
    factory keywords (with defaults) and a ``**kwargs`` beyond the size and eps."""
    params = init.params.params[1:]
    return len(params) >= 2 and all(
        p.name.value in FACTORY_KWARGS and p.default is not None for p in params[2:]
    )


def _index_calling(body, attr: str) -> int:
    for i, s in enumerate(body):
        if attr in t.self_attrs_used(s):
            return i
    raise HfrewriteError(f"{NAME}: self.{attr} is not called in the decoder layer forward")


def decoder_forward(
    fwd: cst.FunctionDef, blocks, attention_blocks: set[str], attention_class: str = ""
) -> cst.FunctionDef:
    """The fused forward of ``blocks``; ``attention_class``: a one-block layer's block is
    an attention of that class in some layers only (block_kinds), called as its kind takes it."""
    src = list(fwd.body.body)
    out: list[cst.BaseStatement] = []
    start = 0
    for i, b in enumerate(blocks):
        end = _index_calling(src, b.block) + 1
        # comments between the previous block call and this one, e.g. "# Fully Connected"
        comments = [c for s in src[start:end] for c in t.leading_comments(s)]
        start = end
        if i == 0:
            norm = t.stmts(
                "if residual is None:\n"
                "    residual = hidden_states\n"
                f"    hidden_states = self.{b.norm}(hidden_states)\n"
                "else:\n"
                f"    hidden_states, residual = self.{b.norm}(hidden_states, residual)\n"
            )
        else:
            norm = t.stmts(f"hidden_states, residual = self.{b.norm}(hidden_states, residual)\n")
        norm[0] = norm[0].with_changes(
            leading_lines=[*([cst.EmptyLine(indent=False)] if i else []), *comments]
        )
        attends = f"hidden_states = self.{b.block}(positions=positions, hidden_states=hidden_states)\n"
        mixes = f"hidden_states = self.{b.block}(hidden_states)\n"
        if attention_class:  # an attention in some layers only: its class says which
            call = f"if isinstance(self.{b.block}, {attention_class}):\n    {attends}else:\n    {mixes}"
        else:
            call = attends if b.block in attention_blocks else mixes
        out += [*norm, t.stmt(call)]
        if b.post_norm:  # sandwich norm on the block's output, before the residual add
            out.append(t.stmt(f"hidden_states = self.{b.post_norm}(hidden_states)\n"))
    out.append(t.stmt("return hidden_states, residual\n"))
    sig = t.stmt(
        "def forward(\n    self,\n    positions: torch.Tensor,\n    hidden_states: torch.Tensor,\n"
        "    residual: torch.Tensor | None,\n) -> tuple[torch.Tensor, torch.Tensor]:\n    pass\n"
    )
    return t.with_body(
        fwd.with_changes(
            params=sig.params,
            returns=sig.returns,
            whitespace_before_params=sig.whitespace_before_params,
        ),
        out,
    )


class _FromConfig(cst.CSTTransformer):
    """``Old(config)`` -> ``New(config.<size>, eps=config.<eps>)``: a norm built from the
    config alone, whose size and eps the analysis found in these fields."""

    def __init__(self, old: str, new: str, fields: tuple[str, str]) -> None:
        self.old, self.new, self.fields, self.count = old, new, fields, 0

    def leave_Call(self, original, updated):
        if t.dotted(updated.func) != self.old:
            return updated
        if len(updated.args) != 1:
            raise HfrewriteError(f"{self.old}: {NAME}: built from the config, called with other arguments")
        self.count += 1
        config = t.code(updated.args[0].value)
        size, eps = self.fields
        return t.expr(f"{self.new}({config}.{size}, eps={config}.{eps})")


def _blocks_of_class(cls: cst.ClassDef, class_name: str) -> set[str]:
    init = t.find_method(cls, "__init__")
    return {
        t.self_attr_assigned(s)
        for s in init.body.body
        if t.self_attr_assigned(s) and t.call_name(t.assigned_value(s)) == class_name
    }


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    plan = ctx.plan
    if plan.norm is None:  # the source's norms are kept; so is the layer's forward
        return PassResult(module=module)
    vllm_norm = plan.norm.kind.vllm_class  # analyze/norm_kinds.py
    norm_init = t.find_method(t.find_class(module, plan.norm.module_class), "__init__")
    params = [p.name.value for p in norm_init.params.params][1:]
    module = inline_norm_aliases(module, plan.norm.module_class)  # `Norm = A if config.x else B`
    if plan.norm.config_fields:  # built from the config alone: its proven fields
        renamer = _FromConfig(plan.norm.module_class, vllm_norm, plan.norm.config_fields)
    elif params[:2] != ["hidden_size", "eps"] and len(params) != 2 and not _factory_extras(norm_init):
        raise HfrewriteError(f"{plan.norm.module_class}: {NAME}: __init__ is not (size, eps)")
    else:
        renamer = _RenameCalls(
            plan.norm.module_class, vllm_norm, dict(zip(params[:2], ["hidden_size", "eps"]))
        )
    # only top-level definitions that name the norm class can call it: the rest is not walked
    module = module.with_changes(
        body=[n.visit(renamer) if plan.norm.module_class in t.names_used(n) else n for n in module.body]
    )
    # the source class is unused now; drop it, as it may share vLLM's name (GemmaRMSNorm)
    module = module.with_changes(
        body=[
            n
            for n in module.body
            if not (isinstance(n, cst.ClassDef) and n.name.value == plan.norm.module_class)
        ]
    )
    rows = [FusionRow(plan.norm.module_class, f"-> vllm {vllm_norm} ({renamer.count} uses)")]
    for decoder in plan.decoder_layers if plan.decoder_layer.fused else ():
        layer = t.find_class(module, decoder.module_class)
        # the analysis's attention child, however __init__ builds it (a class table)
        attention_blocks = (
            _blocks_of_class(layer, plan.attention.module_class) | {decoder.attention_block}
            if plan.attention is not None and decoder is plan.decoder_layer
            else set()  # attention-free, or the mixer's own layer class (Jamba's)
        )
        layer = t.set_method(
            layer,
            decoder_forward(
                t.find_method(layer, "forward"),
                decoder.blocks,
                attention_blocks,
                decoder.block_kinds.attention_class if decoder.block_kinds else "",
            ),
        )
        module = t.replace_class(module, decoder.module_class, layer)
        rows.append(
            FusionRow(
                decoder.module_class,
                f"{len(decoder.blocks)} residual add"
                f"{'s' if len(decoder.blocks) != 1 else ''} fused into the norms",
            )
        )
    return PassResult(module=module, imports=(vllm_norm,), fused=tuple(rows), matches=renamer.count)
