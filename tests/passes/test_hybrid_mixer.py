"""hybrid_mixer: a hybrid model's other mixers as vLLM's ShortConv, MambaMixer2 and
QwenGatedDeltaNetAttention."""

from __future__ import annotations

import dataclasses

import pytest
from hfrewrite.passes import hybrid_mixer

from hfrewrite.analyze.plan import GatedDeltaNetPlan, Mamba2Plan, ShortConvPlan
from hfrewrite.errors import HfrewriteError
from tests.passes.harness import apply, assert_rewrites
from tests.passes.plans import llama_like

CONV = ShortConvPlan(
    module_class="LlamaShortConv", attr="conv", kernel=3, bias=False, layer_test="self.is_attention_layer"
)
PLAN = dataclasses.replace(llama_like(), mixer=CONV)

SHORT_CONV = """\
class LlamaShortConv(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.width = config.hidden_size
        self.conv = nn.Conv1d(self.width, self.width, kernel_size=config.conv_L_cache, groups=self.width)
"""

BEFORE = (
    SHORT_CONV
    + """

class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx, cache_config=None, quant_config=None, prefix=""):
        super().__init__()
        self.is_attention_layer = config.layer_types[layer_idx] == "full_attention"
        if self.is_attention_layer:
            self.self_attn = LlamaAttention(config, cache_config=cache_config, prefix=f"{prefix}.self_attn")
        else:
            self.conv = LlamaShortConv(config, layer_idx)

    def forward(self, positions, hidden_states, residual):
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        return hidden_states, residual


class LlamaForCausalLM(nn.Module, SupportsPP):
    packed_modules_mapping = {}

    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
"""
)

AFTER = (
    SHORT_CONV
    + """

class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx, cache_config=None, quant_config=None, prefix=""):
        super().__init__()
        self.is_attention_layer = config.layer_types[layer_idx] == "full_attention"
        if self.is_attention_layer:
            self.self_attn = LlamaAttention(config, cache_config=cache_config, prefix=f"{prefix}.self_attn")
        else:
            self.conv = ShortConv(
                config,
                dim=config.hidden_size,
                layer_idx=extract_layer_index(prefix),
                model_config=get_current_vllm_config().model_config,
                cache_config=cache_config,
                quant_config=quant_config,
                prefix=f"{prefix}.conv",
            )

    def forward(self, positions, hidden_states, residual):
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.is_attention_layer:
            hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        else:
            output = torch.empty_like(hidden_states)
            self.conv(hidden_states, output)
            hidden_states = output
        return hidden_states, residual


class LlamaForCausalLM(nn.Module, SupportsPP, HasInnerState, IsHybrid):
    packed_modules_mapping = {}

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
            intermediate_size=config.hidden_size,
            conv_kernel=config.conv_L_cache,
        )

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple[MambaStateCopyFunc, ...]:
        return MambaStateCopyFuncCalculator.short_conv_state_copy_func()

    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
"""
)


def test_the_mixer_becomes_shortconv_chosen_by_the_layers_own_test():
    assert_rewrites(hybrid_mixer, BEFORE, AFTER, PLAN)


def test_attention_in_the_else_branch_keeps_its_side():
    plan = dataclasses.replace(
        PLAN, mixer=dataclasses.replace(CONV, layer_test="self.is_conv", attention_when=False)
    )
    out = apply(hybrid_mixer, BEFORE, plan).module.code
    assert "        if self.is_conv:\n            output = torch.empty_like(hidden_states)\n" in out
    assert "        else:\n            hidden_states = self.self_attn(" in out


def test_channels_not_read_off_the_config_refuse():
    before = BEFORE.replace("self.width = config.hidden_size", "self.width = layer_idx * 8")
    with pytest.raises(HfrewriteError, match="not an expression of its config"):
        apply(hybrid_mixer, before, PLAN)


def test_no_plan_no_change():
    assert apply(hybrid_mixer, BEFORE, llama_like()).module.code == BEFORE


MAMBA2 = Mamba2Plan(
    module_class="LlamaMamba",
    attr="mamba",
    args=(
        ("hidden_size", "config.hidden_size"),
        ("conv_kernel_size", "config.mamba_d_conv"),
        ("intermediate_size", "int(config.mamba_expand * config.hidden_size)"),
        ("use_conv_bias", "config.mamba_conv_bias"),
        ("use_bias", "config.mamba_proj_bias"),
        ("num_heads", "config.mamba_n_heads"),
        ("head_dim", "config.mamba_d_head"),
        ("rms_norm_eps", "config.rms_norm_eps"),
        ("activation", "config.hidden_act"),
        ("n_groups", "config.mamba_n_groups"),
        ("ssm_state_size", "config.mamba_d_state"),
    ),
    fixed=(("config.mamba_n_groups == 1", "proven with one group only"),),
    layer_test='self.block_type == "linear_attention"',
    attention_when=False,
)

MAMBA2_BEFORE = """\
class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_type, cache_config=None, quant_config=None, prefix=""):
        super().__init__()
        self.block_type = layer_type
        if layer_type == "linear_attention":
            self.mamba = LlamaMamba(config=config, layer_idx=layer_idx)
        else:
            self.self_attn = LlamaAttention(config, cache_config=cache_config, prefix=f"{prefix}.self_attn")

    def forward(self, positions, hidden_states, residual):
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        return hidden_states, residual


class LlamaForCausalLM(nn.Module, SupportsPP):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
"""

MAMBA2_AFTER = """\
class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_type, cache_config=None, quant_config=None, prefix=""):
        super().__init__()
        if config.mamba_n_groups != 1:
            raise ValueError('hfrewrite: this file needs config.mamba_n_groups == 1: proven with one group only')
        self.block_type = layer_type
        if layer_type == "linear_attention":
            self.mamba = MambaMixer2(
                hidden_size=config.hidden_size,
                conv_kernel_size=config.mamba_d_conv,
                intermediate_size=int(config.mamba_expand * config.hidden_size),
                use_conv_bias=config.mamba_conv_bias,
                use_bias=config.mamba_proj_bias,
                num_heads=config.mamba_n_heads,
                head_dim=config.mamba_d_head,
                rms_norm_eps=config.rms_norm_eps,
                activation=config.hidden_act,
                n_groups=config.mamba_n_groups,
                ssm_state_size=config.mamba_d_state,
                model_config=get_current_vllm_config().model_config,
                cache_config=cache_config,
                quant_config=quant_config,
                prefix=f"{prefix}.mamba",
            )
        else:
            self.self_attn = LlamaAttention(config, cache_config=cache_config, prefix=f"{prefix}.self_attn")

    def forward(self, positions, hidden_states, residual):
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.block_type == "linear_attention":
            hidden_states = self.mamba(hidden_states)
        else:
            hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        return hidden_states, residual


class LlamaForCausalLM(nn.Module, SupportsPP, HasInnerState, IsHybrid):

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return MambaStateDtypeCalculator.mamba2_state_dtype(
            vllm_config.model_config.dtype,
            vllm_config.cache_config.mamba_cache_dtype,
            vllm_config.cache_config.mamba_ssm_cache_dtype,
        )

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        # Each Mamba-2 layer's convolution window and recurrent state, sharded over
        # tensor-parallel ranks by heads and groups.
        config = vllm_config.model_config.hf_config
        return MambaStateShapeCalculator.mamba2_state_shape(
            tp_world_size=vllm_config.parallel_config.tensor_parallel_size,
            intermediate_size=int(config.mamba_expand * config.hidden_size),
            n_groups=config.mamba_n_groups,
            num_heads=config.mamba_n_heads,
            head_dim=config.mamba_d_head,
            state_size=config.mamba_d_state,
            conv_kernel=config.mamba_d_conv,
            num_spec=vllm_config.num_speculative_tokens,
        )

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple[MambaStateCopyFunc, ...]:
        return MambaStateCopyFuncCalculator.mamba2_state_copy_func()

    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
"""


def test_a_mamba2_block_becomes_mambamixer2_built_from_its_proven_expressions():
    """MambaMixer2 returns its output (no buffer), the checks of what the file was proven with
    come first in the layer's __init__, and its state classmethods read the same expressions."""
    plan = dataclasses.replace(llama_like(), mixer=MAMBA2)
    assert_rewrites(hybrid_mixer, MAMBA2_BEFORE, MAMBA2_AFTER, plan)


GDN = GatedDeltaNetPlan(
    module_class="LlamaMamba",
    attr="mamba",
    fixed=(('config.hidden_act in ("silu", "swish")', "silu"),),
    layer_test='self.block_type == "linear_attention"',
    attention_when=False,
)


def test_a_gated_delta_net_becomes_vllms_built_from_the_whole_config():
    """vLLM's gated delta net reads its sizes off the config and takes the vLLM config whole;
    the checkpoint's q, k, v and z are not interleaved per key head; its state classmethods
    read the text config's linear-attention sizes."""
    plan = dataclasses.replace(llama_like(), mixer=GDN)
    out = apply(hybrid_mixer, MAMBA2_BEFORE, plan).module.code
    checked = """\
        super().__init__()
        if config.hidden_act not in ('silu', 'swish'):
            raise ValueError('hfrewrite: this file needs config.hidden_act in ("silu", "swish"): silu')
"""
    assert checked in out
    built = """\
            self.mamba = QwenGatedDeltaNetAttention(
                config,
                vllm_config=get_current_vllm_config(),
                prefix=f"{prefix}.mamba",
                gqa_interleaved_layout=False,
            )
"""
    assert built in out
    assert "            hidden_states = self.mamba(hidden_states)\n" in out
    assert "class LlamaForCausalLM(nn.Module, SupportsPP, HasInnerState, IsHybrid):" in out
    assert "MambaStateShapeCalculator.gated_delta_net_state_shape(" in out
    assert "config = vllm_config.model_config.hf_text_config\n" in out
    assert "MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()" in out


CARRIED_BEFORE = (
    SHORT_CONV
    + """

class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx, cache_config=None, quant_config=None, prefix=""):
        super().__init__()
        self.conv = LlamaShortConv(config, layer_idx) if config.kinds[layer_idx] == "conv" else None

    def forward(self, positions, hidden_states):
        residual = hidden_states
        if self.conv is not None:
            mixed = self.conv(self.norm(hidden_states))
        else:
            mixed = self.self_attn(positions=positions, hidden_states=self.norm(hidden_states))
        return residual + mixed * self.multiplier


class LlamaForCausalLM(nn.Module, SupportsPP):
    packed_modules_mapping = {}
"""
)


def test_a_carried_layer_keeps_its_test_and_gives_shortconv_a_buffer():
    """A carried forward (carry_decoder_layer gave the mixer the hidden states alone) keeps
    the source's test; ShortConv, which writes into a buffer, is given one."""
    carried = dataclasses.replace(PLAN.decoder_layer, blocks=())
    plan = dataclasses.replace(PLAN, decoder_layer=carried)
    with pytest.raises(HfrewriteError, match="not built once"):  # built by an expression, not a statement
        apply(hybrid_mixer, CARRIED_BEFORE, plan)
    before = CARRIED_BEFORE.replace(
        '        self.conv = LlamaShortConv(config, layer_idx) if config.kinds[layer_idx] == "conv" else None\n',
        '        self.conv = None\n        if config.kinds[layer_idx] == "conv":\n            self.conv = LlamaShortConv(config, layer_idx)\n',
    )
    out = apply(hybrid_mixer, before, plan).module.code
    assert (
        "        if self.conv is not None:\n"
        "            mixer_input = self.norm(hidden_states)\n"
        "            mixed = torch.empty_like(mixer_input)\n"
        "            self.conv(mixer_input, mixed)\n"
        "        else:\n"
    ) in out
    assert "            self.conv = ShortConv(\n" in out


def test_the_sources_registration_of_the_mixers_factors_goes():
    """Falcon-H1's base model registers the full muP vector on every block; the file's mixer
    builds its own, cut per rank: the loop and the local it read go, nothing else."""
    import libcst as cst

    from passes.hybrid_mixer import _WithoutRegistration

    source = """\
class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embedding_multiplier = config.embedding_multiplier
        mup_vector = compute_mup_vector(config)
        for layer in self.layers:
            layer.mamba.register_buffer("mup_vector", mup_vector.clone(), persistent=False)
        self.other = compute_mup_vector(config)
"""
    out = (
        cst.parse_module(source).visit(_WithoutRegistration("mup_vector", "compute_mup_vector(config)")).code
    )
    assert (
        out
        == """\
class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embedding_multiplier = config.embedding_multiplier
        self.other = compute_mup_vector(config)
"""
    )
