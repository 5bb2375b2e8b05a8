"""The state a hybrid model's other mixers keep, as vLLM sizes it: the causal LM's state
classmethods for each kind of mixer (passes/hybrid_mixer.py), and the causal LM made a
hybrid (or attention-free) model with them."""

from __future__ import annotations

import libcst as cst

from hfrewrite.analyze.mixer_plans import (
    GatedDeltaNetPlan,
    LightningPlan,
    Mamba1Plan,
    Mamba2Plan,
    ShortConvPlan,
)
from hfrewrite.emit import cst_tools as t
from hfrewrite.errors import HfrewriteError

_SHORT_CONV_STATE = """\
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

_LIGHTNING_STATE = """\
@classmethod
def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
    return MambaStateDtypeCalculator.linear_attention_state_dtype(
        vllm_config.model_config.dtype, vllm_config.cache_config.mamba_cache_dtype
    )

@classmethod
def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
    # Each lightning-attention layer's state, a [head_dim, head_dim] matrix per head, the
    # heads sharded over tensor-parallel ranks.
    config = vllm_config.model_config.hf_config
    return MambaStateShapeCalculator.linear_attention_state_shape(
        num_heads=config.num_attention_heads,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        head_dim=config.head_dim,
    )

@classmethod
def get_mamba_state_copy_func(cls) -> tuple[MambaStateCopyFunc, ...]:
    return MambaStateCopyFuncCalculator.linear_attention_state_copy_func()
"""

# The state classmethods of a layer with a convolution and a recurrent state (Mamba-2, gated
# delta nets): ``{kind}`` names vLLM's calculators, ``{shape}`` the shape's body.
_RECURRENT_STATE = """\
@classmethod
def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
    return MambaStateDtypeCalculator.{kind}_state_dtype(
        vllm_config.model_config.dtype,
        vllm_config.cache_config.mamba_cache_dtype,
        vllm_config.cache_config.mamba_ssm_cache_dtype,
    )

@classmethod
def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
{shape}
@classmethod
def get_mamba_state_copy_func(cls) -> tuple[MambaStateCopyFunc, ...]:
    return MambaStateCopyFuncCalculator.{kind}_state_copy_func()
"""

_MAMBA2_SHAPE = """\
    # Each Mamba-2 layer's convolution window and recurrent state, sharded over
    # tensor-parallel ranks by heads and groups.
    config = vllm_config.model_config.hf_config
    return MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=vllm_config.parallel_config.tensor_parallel_size,
        intermediate_size={intermediate_size},
        n_groups={n_groups},
        num_heads={num_heads},
        head_dim={head_dim},
        state_size={ssm_state_size},
        conv_kernel={conv_kernel_size},
        num_spec=vllm_config.num_speculative_tokens,
    )
"""

_MAMBA1_SHAPE = """\
    # Each Mamba-1 layer's convolution window and recurrent state, a state per
    # channel, the channels sharded over tensor-parallel ranks.
    config = vllm_config.model_config.hf_config
    return MambaStateShapeCalculator.mamba1_state_shape(
        tp_world_size=vllm_config.parallel_config.tensor_parallel_size,
        intermediate_size={intermediate_size},
        state_size={ssm_state_size},
        conv_kernel={conv_kernel_size},
    )
"""

_GDN_SHAPE = """\
    # Each gated delta net's convolution window over q, k and v, and its recurrent
    # state per value head, sharded over tensor-parallel ranks.
    config = vllm_config.model_config.hf_text_config
    return MambaStateShapeCalculator.gated_delta_net_state_shape(
        vllm_config.parallel_config.tensor_parallel_size,
        config.linear_num_key_heads,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
        config.linear_conv_kernel_dim,
        vllm_config.num_speculative_tokens,
    )
"""

STATE_IMPORTS = (
    "MambaStateCopyFunc",
    "MambaStateCopyFuncCalculator",
    "MambaStateDtypeCalculator",
    "MambaStateShapeCalculator",
    "HasInnerState",
    "get_current_vllm_config",
    "VllmConfig",
)


def short_conv_state(plan: ShortConvPlan, module: cst.Module) -> str:
    return _SHORT_CONV_STATE.format(channels=channels(module, plan.module_class))


def mamba2_state(plan: Mamba2Plan, module: cst.Module) -> str:
    return _RECURRENT_STATE.format(kind="mamba2", shape=_MAMBA2_SHAPE.format(**dict(plan.args)))


def mamba1_state(plan: Mamba1Plan, module: cst.Module) -> str:
    return _RECURRENT_STATE.format(kind="mamba1", shape=_MAMBA1_SHAPE.format(**dict(plan.args)))


def channels(module: cst.Module, block: str) -> str:
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
        raise HfrewriteError(f"{block}: hybrid_mixer: self.conv is not built once as nn.Conv1d")
    width = t.resolved_self(t.code(t.arg(convs[0], 0, "in_channels")), t.init_exprs(cls))
    params = [p.name.value for p in init.params.params]
    if len(params) < 2 or params[1] != "config" or t.root_names(t.expr(width)) - {"config"}:
        raise HfrewriteError(
            f"{block}: hybrid_mixer: its channels ({width}) are not an expression of its config"
        )
    return width


def hybrid_lm(lm: cst.ClassDef, state_methods: str, contract: str) -> cst.ClassDef:
    """The causal LM as a hybrid (or attention-free) model: the interfaces and the state
    classmethods."""
    bases = [*lm.bases, cst.Arg(cst.Name("HasInnerState")), cst.Arg(cst.Name(contract))]
    methods = list(cst.parse_module(state_methods).body)
    members = list(lm.body.body)
    at = next((i for i, s in enumerate(members) if isinstance(s, cst.FunctionDef)), len(members))
    methods = [s.with_changes(leading_lines=[cst.EmptyLine(indent=False)]) for s in methods]
    if (
        at < len(members) and not members[at].leading_lines
    ):  # the methods that followed stay a blank line apart
        members[at] = members[at].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    return lm.with_changes(
        bases=bases, body=lm.body.with_changes(body=[*members[:at], *methods, *members[at:]])
    )


def gdn_state(plan: GatedDeltaNetPlan, module: cst.Module) -> str:
    return _RECURRENT_STATE.format(kind="gated_delta_net", shape=_GDN_SHAPE)


def lightning_state(plan: LightningPlan, module: cst.Module) -> str:
    return _LIGHTNING_STATE
