"""Run a hybrid model's other mixer layers as vLLM's own layer of that kind, with its state cache.

Matches the decoder layer when the analysis proved its other mixer one of vLLM's state-caching
layers (``ModelPlan.mixer``): a gated short convolution (LFM2's ``Lfm2ShortConv``) as
``ShortConv``, a Mamba-2 block (Bamba's ``BambaMixer``) as ``MambaMixer2``, a Mamba-1 block
(Mamba's, FalconMamba's) as ``MambaMixer``, a gated delta net (Qwen3.5's, Qwen3-Next's) as
``QwenGatedDeltaNetAttention`` (OLMo-hybrid's as ``OlmoHybridGatedDeltaNetAttention``), each replayed against vLLM's formula; and the layer forward's own test choosing it (``self.is_attention_layer``,
proven on every traced layer). Each kind is one row (``ROWS``): how vLLM builds it, how the
layer calls it, and the classmethods vLLM sizes its state with.

Emits, as vLLM's ``lfm2.py`` and ``granitemoehybrid.py`` do:

* in the layer's ``__init__``, the source's block built as vLLM's class, with
  ``model_config``, ``cache_config``, ``quant_config`` and ``prefix=f"{prefix}.<attr>"``; its
  parts load the checkpoint's tensors under their own names (Mamba-2's ``A_log`` as ``A``,
  load_weights). ShortConv takes the config and the block's channels; MambaMixer2 takes
  the expressions of the config the analysis proved for each of its sizes, after checks that
  refuse the configs beyond that proof (``Mamba2Plan.fixed``: time steps vLLM would not
  clamp, a convolution activation other than silu, more groups than the traced one); the gated
  delta net takes the config and the whole vLLM config, with the layout of its projections
  (``gqa_interleaved_layout``), after checks of the silu it applies;
* a Mamba-2 block with muP factors (Falcon-H1's, ``Mamba2Plan.input_scale`` and
  ``projection_scale``) as ``ScaledMambaMixer2`` (templates/mamba2.py), built with the source's
  expressions of them; the source's statements registering the full factor vector on every
  block go, the file's mixer cutting its own to the rank's columns; one whose time steps
  are floored (NemotronH's ``time_step_min``, ``Mamba2Plan.time_step_floor``) as
  ``FlooredMambaMixer2``, built with the source's expression of the floor; one whose gated
  norm spans all channels however many groups it has (``Mamba2Plan.norm_spans_groups``) as
  ``SpanNormMambaMixer2``;
* OLMo-hybrid's gated delta net as ``TorchOlmoGatedDeltaNet`` (templates/gated_delta_net.py):
  vLLM's ``OlmoHybridGatedDeltaNetAttention``, writing into the buffer it is given, its delta
  rule run in torch on vLLM's CPU build (which has no kernel for it), its convolution's loader
  taking the shard id the weights mapper gives;
* MiniMax's lightning attention as ``TorchMiniMaxLinearAttention``
  (templates/lightning_attention.py): vLLM's ``MiniMaxText01LinearAttention`` with the
  block's norm epsilon and the checkpoint's decay rates, writing into a buffer (with the
  positions), its recurrence in torch on vLLM's CPU build; where one child holds it or the
  attention by layer, the forward chooses the call by that child's class
  (``isinstance(self.self_attn, <attention class>)``) and ``__init__`` loses the first
  construction of the child that its own test then overwrites;
* a Mamba-1 block as ``TorchScanMambaMixer`` (templates/mamba1.py): vLLM's ``MambaMixer``,
  its scan run in torch on vLLM's CPU build, which has no kernel for it; built with the
  source's expressions of its sizes and norms, without a quantization config (vLLM's takes
  none); a one-block layer's ``x = self.mixer(x)`` writes into a buffer of its own;
* in its fused forward, the attention call under the source's test, and in the other branch
  the mixer (ShortConv writes into an output buffer; MambaMixer2 returns its output); a
  carried forward (Granite-4.0-H's) keeps the source's test, and carry_decoder_layer has
  already given the mixer the hidden states alone (a buffer is made for ShortConv); with no
  attention at all (Bamba's default config) the fused forward calls the mixer alone, and
  ``__init__`` takes the branch every traced layer took, refusing the configs taking another;
* on the causal LM, ``IsHybrid`` (``IsAttentionFree`` where no layer attends: a Mamba-2
  model) and ``HasInnerState`` and the three state classmethods.

Preconditions: the layer's forward is vLLM's fused-residual one (fused_residual_norm) calling
``self.<attention>(positions=..., hidden_states=...)``, or carried with one
``y = self.<mixer>(x)``; the block is built from the config the layer's ``__init__`` is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from hfrewrite.analyze.mixer_plans import (
    GatedDeltaNetPlan,
    LightningPlan,
    Mamba1Plan,
    Mamba2Plan,
    MixerPlan,
    ShortConvPlan,
)
from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.mixer_init import fixed_check, without_overwritten
from hfrewrite.emit.mixer_states import (
    STATE_IMPORTS,
    channels,
    gdn_state,
    hybrid_lm,
    lightning_state,
    mamba1_state,
    mamba2_state,
    short_conv_state,
)
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites
from hfrewrite.emit.taken_init import with_traced_branches
from hfrewrite.emit.templates_io import insert_before, template_class
from hfrewrite.errors import HfrewriteError

NAME = "hybrid_mixer"


@dataclass(frozen=True)
class _Row:
    """How one kind of mixer is emitted."""

    vllm_class: str
    # (plan, source module) -> the arguments vLLM's class is built with, before the shared ones
    arguments: Callable[[MixerPlan, cst.Module], str]
    # (plan, source module) -> the causal LM's state classmethods
    state_methods: Callable[[MixerPlan, cst.Module], str]
    writes_into_buffer: bool  # called as ``mixer(x, output)`` rather than ``output = mixer(x)``
    imports: tuple[str, ...]
    # plan -> (condition, why) the config must meet, checked before the layer is built
    checks: Callable[[MixerPlan], tuple[tuple[str, str], ...]] = lambda plan: ()
    # plan -> the arguments after the kind's own: vLLM's layers built from parts take the
    # configs apart; a gated delta net takes the whole vLLM config
    shared: Callable[[MixerPlan], str] = lambda plan: (
        "model_config=get_current_vllm_config().model_config,\n"
        "cache_config=cache_config,\nquant_config=quant_config,\n"
        f'prefix=f"{{prefix}}.{plan.attr}",\n'
    )
    # the call's arguments after the hidden states and the buffer (lightning attention's positions)
    extra_call_args: str = ""


def _short_conv_arguments(plan: ShortConvPlan, module: cst.Module) -> str:
    return f"config,\ndim={channels(module, plan.module_class)},\nlayer_idx=extract_layer_index(prefix),\n"


def _keyword_arguments(plan: Mamba2Plan | Mamba1Plan, module: cst.Module) -> str:
    return "".join(f"{kw}={expr},\n" for kw, expr in plan.args)


def _mamba1_shared(plan: Mamba1Plan) -> str:
    # vLLM's MambaMixer takes no quantization config
    return (
        "model_config=get_current_vllm_config().model_config,\n"
        f'cache_config=cache_config,\nprefix=f"{{prefix}}.{plan.attr}",\n'
    )


def _config_argument(plan: GatedDeltaNetPlan | LightningPlan, module: cst.Module) -> str:
    """vLLM's gated delta nets and lightning attention read their sizes off the config itself."""
    return "config,\n"


def _gdn_shared(plan: GatedDeltaNetPlan) -> str:
    # Qwen3-Next's checkpoint interleaves q, k, v, z (and b, a) per key head; Qwen3.5's keeps them apart
    return (
        f'vllm_config=get_current_vllm_config(),\nprefix=f"{{prefix}}.{plan.attr}",\n'
        f"gqa_interleaved_layout={plan.interleaved},\n"
    )


ROWS: dict[type, _Row] = {
    ShortConvPlan: _Row(
        "ShortConv", _short_conv_arguments, short_conv_state, True, ("ShortConv", "extract_layer_index")
    ),
    Mamba2Plan: _Row(
        "MambaMixer2", _keyword_arguments, mamba2_state, False, ("MambaMixer2",), lambda plan: plan.fixed
    ),
    # vLLM's MambaMixer, with its scan in torch where vLLM's CPU build has no kernel for it
    Mamba1Plan: _Row(
        "TorchScanMambaMixer",
        _keyword_arguments,
        mamba1_state,
        True,
        ("MambaMixer",),
        lambda plan: plan.fixed,
        _mamba1_shared,
    ),
    GatedDeltaNetPlan: _Row(
        "QwenGatedDeltaNetAttention",
        _config_argument,
        gdn_state,
        False,
        ("QwenGatedDeltaNetAttention",),
        lambda plan: plan.fixed,
        _gdn_shared,
    ),
    # vLLM's lightning attention, its norm's epsilon the block's, its recurrence in torch
    # where vLLM's CPU build has no kernel for it
    LightningPlan: _Row(
        "TorchMiniMaxLinearAttention",
        _config_argument,
        lightning_state,
        True,
        ("MiniMaxText01LinearAttention",),
        lambda plan: plan.fixed,
        lambda plan: (
            f'vllm_config=get_current_vllm_config(),\nprefix=f"{{prefix}}.{plan.attr}",\n'
            f"norm_eps={plan.norm_eps},\n"
        ),
        ", positions",
    ),
}


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    mixer = ctx.plan.mixer
    if mixer is None:
        return PassResult(module=module)
    row = ROWS[type(mixer)]
    layer = ctx.plan.mixer_layer or ctx.plan.decoder_layer  # (Jamba's mixer layers: a class of their own)
    row, module, arguments = _subclassed(mixer, row, module, layer.module_class)
    sites = Sites()
    # one child holding attention or the mixer by layer (MiniMax's), not a layer of one block
    # (NemotronH's) nor the mixer's own class (Jamba's)
    shared_child = ctx.plan.mixer_shares_child
    cls = t.find_class(module, layer.module_class)
    init = t.find_method(cls, "__init__")
    init = (without_overwritten(init, mixer.attr) if shared_child else init).visit(
        _BuildMixer(mixer, row, arguments)
    )
    forward = t.find_method(cls, "forward")
    one_block = layer.block_kinds is not None  # its forward calls the block as its class takes it
    if one_block and layer.block_kinds.table and row.writes_into_buffer:
        raise HfrewriteError(
            f"{mixer.module_class}: {NAME}: a layer choosing its block by kind, writing into a buffer"
        )
    own_class = ctx.plan.mixer_layer is not None  # its layers call the mixer alone
    if shared_child or (not one_block and layer.fused and ctx.plan.attention is not None and not own_class):
        forward = _choosing_forward(forward, layer.attention_block, mixer, row)
    elif row.writes_into_buffer:  # a carried forward's own test chooses; no attention: the mixer alone
        forward = forward.visit(_IntoBuffer(mixer.attr, forward))
    cls = t.set_method(t.set_method(cls, init), forward)
    if layer.fused and ctx.plan.attention is None:  # the test choosing the mixer, refused otherwise
        switches = [
            (test, value) for owner, test, value in ctx.plan.forward_switches if owner == layer.module_class
        ]
        cls = with_traced_branches(cls, switches, t.init_exprs(cls))
    module = sites.replace_class(module, layer.module_class, cls)
    lm = t.find_class(module, ctx.plan.architecture)
    # no attention at all (a Mamba-2 model): vLLM's attention-free contract, no KV cache
    contract = "IsHybrid" if ctx.plan.attention is not None else "IsAttentionFree"
    module = sites.replace_class(
        module, ctx.plan.architecture, hybrid_lm(lm, row.state_methods(mixer, module), contract)
    )
    fused = FusionRow(
        layer.module_class,
        f"{mixer.attr}: {mixer.module_class} -> {row.vllm_class} (its state cached by vLLM)",
    )
    return PassResult(
        module=module,
        imports=(*row.imports, *STATE_IMPORTS, contract),
        fused=(fused,),
        matches=sites.count,
    )


def _subclassed(mixer: MixerPlan, row: _Row, module: cst.Module, layer: str) -> tuple[_Row, cst.Module, str]:
    """The row, the module (with a template's subclass of vLLM's layer before ``layer``'s
    class where the block needs one) and the arguments vLLM's class is built with."""
    arguments = row.arguments(mixer, module)
    if isinstance(mixer, Mamba2Plan) and (mixer.input_scale or mixer.projection_scale):
        arguments = _scales(mixer) + arguments
        row, module = _templated(row, module, layer, "ScaledMambaMixer2", "get_tensor_model_parallel_rank")
        module = module.visit(_WithoutRegistration(mixer.projection_buffer, mixer.projection_scale))
    elif isinstance(mixer, Mamba2Plan) and mixer.time_step_floor:  # NemotronH's
        row, module = _templated(row, module, layer, "FlooredMambaMixer2", "get_forward_context")
        arguments = f"time_step_min={mixer.time_step_floor},\n{arguments}"
    elif isinstance(mixer, Mamba2Plan) and mixer.norm_spans_groups:  # transformers' Mamba-2's
        row, module = _templated(row, module, layer, "SpanNormMambaMixer2", "Mixer2RMSNormGated")
    elif isinstance(mixer, Mamba1Plan):
        row, module = _templated(row, module, layer, "TorchScanMambaMixer", *_SCAN_IMPORTS, file="mamba1.py")
    elif isinstance(mixer, LightningPlan):
        row, module = _templated(
            row,
            module,
            layer,
            "TorchMiniMaxLinearAttention",
            "get_forward_context",
            "current_platform",
            file="lightning_attention.py",
        )
    elif isinstance(mixer, GatedDeltaNetPlan) and mixer.layout == "olmo":
        row, module = _templated(
            OLMO_GDN, module, layer, "TorchOlmoGatedDeltaNet", *_OLMO_IMPORTS, file="gated_delta_net.py"
        )
    return row, module, arguments


def _scales(mixer: Mamba2Plan) -> str:
    """The arguments of Falcon-H1's muP factors (ScaledMambaMixer2), the source's own
    expressions of them."""
    return (
        f"input_scale={mixer.input_scale or '1.0'},\nprojection_scale={mixer.projection_scale or 'None'},\n"
    )


# OLMo-hybrid's: vLLM's OlmoHybridGatedDeltaNetAttention, writing into the buffer it is given,
# with its delta rule in torch where vLLM's CPU build has no kernel for it
OLMO_GDN = dataclasses.replace(
    ROWS[GatedDeltaNetPlan],
    writes_into_buffer=True,
    imports=("OlmoHybridGatedDeltaNetAttention",),
    shared=lambda plan: f'vllm_config=get_current_vllm_config(),\nprefix=f"{{prefix}}.{plan.attr}",\n',
)
# what templates/gated_delta_net.py's TorchOlmoGatedDeltaNet reads besides vLLM's layer
_OLMO_IMPORTS = (
    "mock",
    "get_forward_context",
    "olmo_gdn_linear_attn",
    "is_conv_state_dim_first",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "current_platform",
)


# what templates/mamba1.py's TorchScanMambaMixer reads besides vLLM's MambaMixer
_SCAN_IMPORTS = (
    "pairwise",
    "get_forward_context",
    "split_batch_to_prefill_and_decode",
    "is_conv_state_dim_first",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "current_platform",
)


def _templated(
    row: _Row, module: cst.Module, layer: str, vllm_class: str, *imports: str, file: str = "mamba2.py"
) -> tuple[_Row, cst.Module]:
    """``row`` building the ``vllm_class`` of ``templates/<file>`` (a subclass of vLLM's
    mixer), with the names it imports, and ``module`` with that class before the layer's."""
    row = dataclasses.replace(row, vllm_class=vllm_class, imports=(*row.imports, *imports))
    return row, insert_before(module, layer, template_class(file, vllm_class, {}, {}))


class _WithoutRegistration(cst.CSTTransformer):
    """The source's ``<x>.register_buffer("<buffer>", ...)`` statements (Falcon-H1's base model
    registering the projection's factors on every block): the file's mixer builds its own,
    cut to its rank's columns. A loop left empty goes with them."""

    def __init__(self, buffer: str, built: str) -> None:
        self.buffer, self.built = buffer, built  # and the expression the source built it with

    def leave_FunctionDef(self, original, updated):
        """Without ``x = <built>`` where nothing reads ``x`` any more (the analysis evaluated
        that expression: it only computes the factors)."""
        if updated is original:
            return updated
        body = [
            s
            for s in updated.body.body
            if not (
                isinstance(s, cst.SimpleStatementLine)
                and isinstance(s.body[0], cst.Assign)
                and t.code(s.body[0].value) == self.built
                and isinstance(target := s.body[0].targets[0].target, cst.Name)
                and target.value
                not in t.names_used(
                    updated.body.with_changes(body=[o for o in updated.body.body if o is not s])
                )
            )
        ]
        return t.with_body(updated, body)

    def leave_SimpleStatementLine(self, original, updated):
        call = updated.body[0].value if isinstance(updated.body[0], cst.Expr) else None
        if (
            isinstance(call, cst.Call)
            and (t.call_name(call) or "").endswith(".register_buffer")
            and call.args
            and m.matches(call.args[0].value, m.SimpleString())
            and call.args[0].value.evaluated_value == self.buffer
        ):
            return cst.RemoveFromParent()
        return updated

    def leave_For(self, original, updated):
        return cst.RemoveFromParent() if not updated.body.body else updated


class _BuildMixer(cst.CSTTransformer):
    """``self.<attr> = <Block>(config, ...)`` -> ``self.<attr> = <vLLM class>(...)``, after
    the checks of the config values vLLM's class assumes."""

    def __init__(self, mixer: MixerPlan, row: _Row, arguments: str) -> None:
        self.mixer, self.row, self.arguments, self.built = mixer, row, arguments, 0

    def leave_SimpleStatementLine(self, original, updated):
        if t.self_attr_assigned(updated) != self.mixer.attr:
            return updated
        call = t.assigned_value(updated)
        if (
            t.call_name(call) != self.mixer.module_class
            or not call.args
            or not m.matches(call.args[0].value, m.Name("config"))
        ):
            return updated
        self.built += 1
        shared = self.row.shared(self.mixer)
        lines = "".join(f"    {line}\n" for line in (self.arguments + shared).splitlines())
        built = t.stmt(f"self.{self.mixer.attr} = {self.row.vllm_class}(\n{lines})\n")
        return built.with_changes(leading_lines=updated.leading_lines)

    def leave_FunctionDef(self, original, updated):
        """The checks of the config first: a config the file refuses builds no layer."""
        if self.built != 1:
            raise HfrewriteError(
                f"{self.mixer.module_class}: {NAME}: not built once as self.{self.mixer.attr} from the layer's config"
            )
        checks = "".join(t.code(fixed_check(*fixed)) for fixed in self.row.checks(self.mixer))
        return t.with_body(updated, t.guards_first(list(updated.body.body), checks))


def _choosing_forward(
    forward: cst.FunctionDef, attention: str, mixer: MixerPlan, row: _Row
) -> cst.FunctionDef:
    """``forward`` with its attention call under the source's test and the mixer in the
    other branch."""
    body = list(forward.body.body)
    calls = [
        i
        for i, s in enumerate(body)
        if m.matches(
            s,
            m.SimpleStatementLine(
                body=[
                    m.Assign(
                        targets=[m.AssignTarget(target=m.Name())],
                        value=m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(attention))),
                    )
                ]
            ),
        )
    ]
    if len(calls) != 1:
        raise HfrewriteError(f"{attention}: {NAME}: the layer's forward does not call self.{attention} once")
    at = calls[0]
    call = t.assigned_value(body[at])
    stream = t.code(t.arg(call, 1, "hidden_states"))
    target = body[at].body[0].targets[0].target.value
    if row.writes_into_buffer:
        output = "output" if "output" not in t.names_used(forward) else "mixed"
        called = f"self.{mixer.attr}({stream}, {output}{row.extra_call_args})"
        other = f"{output} = torch.empty_like({stream})\n{called}\n{target} = {output}\n"
    else:
        other = f"{target} = self.{mixer.attr}({stream})\n"
    attended = t.code(body[at]).strip() + "\n"
    then, orelse = (attended, other) if mixer.attention_when else (other, attended)
    choice = t.stmt(f"if {mixer.layer_test}:\n{_indented(then)}else:\n{_indented(orelse)}").with_changes(
        leading_lines=body[at].leading_lines
    )
    return t.with_body(forward, [*body[:at], choice, *body[at + 1 :]])


class _IntoBuffer(cst.CSTTransformer):
    """``y = self.<attr>(x)`` -> ``y = torch.empty_like(x)`` then ``self.<attr>(x, y)``: a
    layer that writes its output into the buffer it is given."""

    def __init__(self, attr: str, forward: cst.FunctionDef) -> None:
        self.func, self.count, self.taken = f"self.{attr}", 0, t.names_used(forward)

    def leave_SimpleStatementLine(self, original, updated):
        one = updated.body[0]
        if not (
            isinstance(one, cst.Assign)
            and len(one.targets) == 1
            and isinstance(one.targets[0].target, cst.Name)
        ):
            return updated
        call, target = one.value, one.targets[0].target
        if t.call_name(call) != self.func or len(call.args) != 1:
            return updated
        self.count += 1
        stream, first = t.code(call.args[0].value), []
        if not isinstance(call.args[0].value, cst.Name):  # computed once, then read twice
            name = "mixer_input" if "mixer_input" not in self.taken else "mixer_input_"
            first, stream = [t.stmt(f"{name} = {stream}\n")], name
        buffer, last = target.value, []
        if buffer == stream:  # `x = self.mixer(x)`: its output goes to a buffer of its own
            buffer = "output" if "output" not in self.taken else "mixer_output"
            last = [t.stmt(f"{target.value} = {buffer}\n")]
        statements = [
            *first,
            t.stmt(f"{buffer} = torch.empty_like({stream})\n"),
            t.stmt(f"{self.func}({stream}, {buffer})\n"),
            *last,
        ]
        statements[0] = statements[0].with_changes(leading_lines=updated.leading_lines)
        return cst.FlattenSentinel(statements)

    def leave_FunctionDef(self, original, updated):
        if self.count != 1:
            raise HfrewriteError(
                f"{self.func}: {NAME}: the carried forward does not call it once as `y = {self.func}(x)`"
            )
        return updated


def _indented(lines: str) -> str:
    return "".join(f"    {line}\n" for line in lines.splitlines())
