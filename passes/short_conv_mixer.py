"""Run a hybrid model's short-convolution layers as vLLM's ``ShortConv``, with its state cache.

Matches the decoder layer when the analysis proved its other mixer a gated short convolution
(``ModelPlan.short_conv``: LFM2's ``Lfm2ShortConv``, replayed against vLLM's formula) and the
layer forward's own test choosing it (``self.is_attention_layer``, proven on every traced layer).

Emits, as vLLM's ``lfm2.py`` does:

* in the layer's ``__init__``, the source's block built as
  ``ShortConv(config, dim=<its channels>, layer_idx=..., model_config=..., cache_config=...,
  quant_config=..., prefix=f"{prefix}.conv")``, whose ``in_proj``, ``conv`` and ``out_proj``
  load the checkpoint's tensors under their own names;
* in its forward, the attention call under the source's test, and in the other branch the
  mixer writing into an output buffer (``ShortConv(hidden_states, output)``);
* on the causal LM, ``IsHybrid`` and ``HasInnerState`` and the classmethods vLLM sizes the
  convolution state with.

Preconditions: the layer's forward is vLLM's fused-residual one (fused_residual_norm) calling
``self.<attention>(positions=..., hidden_states=...)``; the block's channel count is an
expression of the config its ``__init__`` is given.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from hfrewrite.emit import cst_tools as t
from hfrewrite.emit.pass_api import FusionRow, PassContext, PassResult, Sites
from hfrewrite.errors import HfrewriteError

NAME = "short_conv_mixer"

_STATE_METHODS = """\
@classmethod
def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
    return MambaStateDtypeCalculator.short_conv_state_dtype(
        vllm_config.model_config.dtype, vllm_config.cache_config.mamba_cache_dtype
    )

@classmethod
def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, int]]:
    # The convolution state of each short-convolution layer: its channels, sharded
    # over tensor-parallel ranks, by the kernel's length less one.
    config = vllm_config.model_config.hf_config
    return MambaStateShapeCalculator.short_conv_state_shape(
        tp_world_size=vllm_config.parallel_config.tensor_parallel_size,
        intermediate_size={channels},
        conv_kernel=config.conv_L_cache,
    )

@classmethod
def get_mamba_state_copy_func(cls) -> tuple[MambaStateCopyFunc, ...]:
    return MambaStateCopyFuncCalculator.short_conv_state_copy_func()
"""

IMPORTS = (
    "ShortConv",
    "MambaStateCopyFunc",
    "MambaStateCopyFuncCalculator",
    "MambaStateDtypeCalculator",
    "MambaStateShapeCalculator",
    "IsHybrid",
    "HasInnerState",
    "get_current_vllm_config",
    "extract_layer_index",
    "VllmConfig",
)


def run(module: cst.Module, ctx: PassContext) -> PassResult:
    mixer = ctx.plan.short_conv
    if mixer is None:
        return PassResult(module=module)
    layer = ctx.plan.decoder_layer
    if not layer.fused:
        raise HfrewriteError(f"{layer.module_class}: {NAME}: a hybrid layer whose forward is carried")
    channels = _channels(module, mixer.module_class)
    sites = Sites()
    cls = t.find_class(module, layer.module_class)
    init = t.find_method(cls, "__init__").visit(_BuildShortConv(mixer, channels))
    forward = _choosing_forward(t.find_method(cls, "forward"), layer.attention_block, mixer)
    cls = t.set_method(t.set_method(cls, init), forward)
    module = sites.replace_class(module, layer.module_class, cls)
    lm = t.find_class(module, ctx.plan.architecture)
    module = sites.replace_class(module, ctx.plan.architecture, _hybrid_lm(lm, channels))
    row = FusionRow(
        layer.module_class, f"{mixer.attr}: {mixer.module_class} -> ShortConv (its state cached by vLLM)"
    )
    return PassResult(module=module, imports=IMPORTS, fused=(row,), matches=sites.count)


def _channels(module: cst.Module, block: str) -> str:
    """The block's channel count as an expression of the ``config`` its ``__init__`` takes:
    its Conv1d's ``in_channels``, each ``self.x`` replaced by what ``__init__`` assigns it."""
    cls = t.find_class(module, block)
    init = t.find_method(cls, "__init__")
    convs = [
        t.assigned_value(s)
        for s in (n for n in t.walk(init.body) if isinstance(n, cst.SimpleStatementLine))
        if t.self_attr_assigned(s) == "conv" and t.call_name(t.assigned_value(s)) == "nn.Conv1d"
    ]
    if len(convs) != 1:
        raise HfrewriteError(f"{block}: {NAME}: self.conv is not built once as nn.Conv1d")
    channels = t.resolved_self(t.code(t.arg(convs[0], 0, "in_channels")), t.init_exprs(cls))
    params = [p.name.value for p in init.params.params]
    if len(params) < 2 or params[1] != "config" or t.root_names(t.expr(channels)) - {"config"}:
        raise HfrewriteError(
            f"{block}: {NAME}: its channels ({channels}) are not an expression of its config"
        )
    return channels


class _BuildShortConv(cst.CSTTransformer):
    """``self.<attr> = <Block>(config, ...)`` -> ``self.<attr> = ShortConv(config, ...)``."""

    def __init__(self, mixer, channels: str) -> None:
        self.mixer, self.channels, self.built = mixer, channels, 0

    def leave_SimpleStatementLine(self, original, updated):
        if t.self_attr_assigned(updated) != self.mixer.attr:
            return updated
        call = t.assigned_value(updated)
        if (
            t.call_name(call) != self.mixer.module_class
            or not call.args
            or t.code(call.args[0].value) != "config"
        ):
            return updated
        self.built += 1
        return t.stmt(
            f"self.{self.mixer.attr} = ShortConv(\n"
            f"    config,\n    dim={self.channels},\n    layer_idx=extract_layer_index(prefix),\n"
            "    model_config=get_current_vllm_config().model_config,\n"
            "    cache_config=cache_config,\n    quant_config=quant_config,\n"
            f'    prefix=f"{{prefix}}.{self.mixer.attr}",\n)\n'
        ).with_changes(leading_lines=updated.leading_lines)

    def leave_FunctionDef(self, original, updated):
        if self.built != 1:
            raise HfrewriteError(
                f"{self.mixer.module_class}: {NAME}: not built once as self.{self.mixer.attr} from the layer's config"
            )
        return updated


def _choosing_forward(forward: cst.FunctionDef, attention: str, mixer) -> cst.FunctionDef:
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
    output = "output" if "output" not in t.names_used(forward) else "mixed"
    other = (
        f"{output} = torch.empty_like({stream})\nself.{mixer.attr}({stream}, {output})\n{target} = {output}\n"
    )
    attended = t.code(body[at]).strip() + "\n"
    then, orelse = (attended, other) if mixer.attention_when else (other, attended)
    choice = t.stmt(f"if {mixer.layer_test}:\n{_indented(then)}else:\n{_indented(orelse)}").with_changes(
        leading_lines=body[at].leading_lines
    )
    return t.with_body(forward, [*body[:at], choice, *body[at + 1 :]])


def _indented(lines: str) -> str:
    return "".join(f"    {line}\n" for line in lines.splitlines())


def _hybrid_lm(lm: cst.ClassDef, channels: str) -> cst.ClassDef:
    """The causal LM as a hybrid model: the interfaces and the state classmethods."""
    bases = [*lm.bases, cst.Arg(cst.Name("HasInnerState")), cst.Arg(cst.Name("IsHybrid"))]
    methods = list(cst.parse_module(_STATE_METHODS.format(channels=channels)).body)
    members = list(lm.body.body)
    at = next(i for i, s in enumerate(members) if isinstance(s, cst.FunctionDef))
    methods = [s.with_changes(leading_lines=[cst.EmptyLine(indent=False)]) for s in methods]
    return lm.with_changes(
        bases=bases, body=lm.body.with_changes(body=[*members[:at], *methods, *members[at:]])
    )
