"""The plans of a hybrid model's other mixers: the layers that mix tokens with something
other than attention, each proven to compute one of vLLM's own state-caching layers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShortConvPlan:
    """A gated short convolution proven to compute vLLM's ``ShortConv`` (analyze/short_conv.py)."""

    module_class: str  # the source's block class, e.g. "Lfm2ShortConv"
    attr: str  # the decoder layer's child holding it, e.g. "conv"
    kernel: int  # at the traced config: what config.conv_L_cache gives ShortConv
    bias: bool
    # the decoder layer forward's test choosing attention or this mixer (``self.is_attention_layer``),
    # proven on every traced layer; True: attention is its body, the mixer its else
    layer_test: str = ""
    attention_when: bool = True

    vllm_dtype = "float32"  # what vLLM's CPU kernel of it computes in, for validation

    @property
    def checkpoint_suffix_renames(self) -> tuple[tuple[str, str], ...]:
        return ()  # ShortConv's parts load under the checkpoint's names


class _BuiltFromArguments:
    """A Mamba mixer vLLM builds from arguments (``args``: keyword, config expression), whose
    loader takes the checkpoint's ``A_log`` as its ``A`` and makes it ``-exp(A_log)``."""

    attr: str
    args: tuple[tuple[str, str], ...]

    def arg(self, name: str) -> str:
        return dict(self.args)[name]

    @property
    def checkpoint_suffix_renames(self) -> tuple[tuple[str, str], ...]:
        return ((f".{self.attr}.A_log", f".{self.attr}.A"),)


@dataclass(frozen=True)
class Mamba2Plan(_BuiltFromArguments):
    """A Mamba-2 block proven to compute vLLM's ``MambaMixer2`` (analyze/mamba2.py)."""

    module_class: str  # the source's block class, e.g. "BambaMixer"
    attr: str  # the decoder layer's child holding it, e.g. "mamba"
    # MambaMixer2's arguments, each the expression of the block's config that its __init__
    # sizes the block with, proven equal to the traced block's structure
    args: tuple[tuple[str, str], ...]
    # conditions on the config the file requires, (condition, why): the time-step limits
    # vLLM's MambaMixer2 does not clamp to at (0, inf), a silu convolution, one group
    fixed: tuple[tuple[str, str], ...] = ()
    layer_test: str = ""
    attention_when: bool = True
    # Falcon-H1's muP factors (analyze/mamba2_scales.py): the config expression its input is
    # multiplied by, and the modeling module's expression of the per-column factor of its
    # projection (vLLM's mup_vector); "" where the block has none
    input_scale: str = ""
    projection_scale: str = ""
    projection_buffer: str = ""  # the block's buffer holding it, which the source registers
    # the config expression of the floor the block's time steps are clamped at after their
    # softplus (NemotronH's time_step_min, analyze/mamba2_floor.py); "" where it has none
    time_step_floor: str = ""
    # its gated norm spans all channels where its B and C have several groups (transformers'
    # Mamba-2, Bamba), vLLM's normalising each group's
    norm_spans_groups: bool = False

    vllm_dtype = "float32"


@dataclass(frozen=True)
class Mamba1Plan(_BuiltFromArguments):
    """A Mamba-1 block proven to compute vLLM's ``MambaMixer`` (analyze/mamba1.py)."""

    module_class: str  # the source's block class, e.g. "MambaMixer"
    attr: str  # the decoder layer's child holding it, e.g. "mixer"
    # MambaMixer's arguments, each the expression of the block's config its __init__ sizes
    # the block with, proven equal to the traced block's structure
    args: tuple[tuple[str, str], ...]
    fixed: tuple[tuple[str, str], ...] = ()  # as Mamba2Plan's: silu where vLLM applies it
    layer_test: str = ""
    attention_when: bool = True

    vllm_dtype = "float32"


@dataclass(frozen=True)
class GatedDeltaNetPlan:
    """A gated delta net proven to compute vLLM's ``QwenGatedDeltaNetAttention`` or
    ``OlmoHybridGatedDeltaNetAttention`` (analyze/gated_delta_net.py)."""

    module_class: str  # the source's block class, e.g. "Qwen3_5GatedDeltaNet"
    attr: str  # the decoder layer's child holding it, e.g. "linear_attn"
    # Qwen3-Next's in_proj_qkvz and in_proj_ba, interleaved per key head (vLLM's
    # gqa_interleaved_layout), rather than Qwen3.5's four projections
    interleaved: bool = False
    fixed: tuple[tuple[str, str], ...] = ()  # as Mamba2Plan's: silu where vLLM applies it
    layer_test: str = ""
    attention_when: bool = True
    # the config's layer_types entry of the attention layers: a config with it in every
    # layer builds no gated delta net, and validates in float32 ("": none found)
    attention_layer_type: str = ""
    # analyze/gated_delta_net.py's LAYOUTS: "separate" (Qwen3.5), "interleaved" (Qwen3-Next),
    # "olmo" (q, k, v, g, b, a apart: vLLM's OlmoHybridGatedDeltaNetAttention)
    layout: str = "separate"
    # the checkpoint's convolutions concatenated into conv1d at load by transformers
    # (OLMo-hybrid's q_conv1d, k_conv1d, v_conv1d), in order: vLLM's conv1d shards 0, 1, 2
    conv_sources: tuple[str, ...] = ()

    @property
    def vllm_dtype(self) -> str:
        """vLLM's CPU kernel of Qwen's gated delta net asserts bfloat16 inputs
        (ops/cpu/gdn_attention.py); the file's OLMo layer runs its rule in torch there."""
        return "float32" if self.layout == "olmo" else "bfloat16"

    @property
    def checkpoint_suffix_renames(self) -> tuple[tuple[str, str], ...]:
        return ()

    @property
    def stacked_scope(self) -> str:
        """The layer's child the stacked names are qualified by ("": unqualified): OLMo's
        q_proj, k_proj, v_proj are also its attention layers' names."""
        return self.attr if self.layout == "olmo" else ""

    @property
    def stacked_shards(self) -> tuple[tuple[str, str, str], ...]:
        """(vLLM's fused projection, the checkpoint's projection, its shard id as code);
        none where the checkpoint's projections are vLLM's own (interleaved)."""
        if self.layout == "olmo":
            projections = tuple(("in_proj_qkvg", name, str(i)) for i, name in enumerate(OLMO_QKVG))
            return projections + tuple(("conv1d", name, str(i)) for i, name in enumerate(self.conv_sources))
        if self.interleaved:
            return ()
        return (
            ("in_proj_qkvz", "in_proj_qkv", "(0, 1, 2)"),
            ("in_proj_qkvz", "in_proj_z", "3"),
            ("in_proj_ba", "in_proj_b", "0"),
            ("in_proj_ba", "in_proj_a", "1"),
        )


# the projections vLLM's OLMo layer loads into in_proj_qkvg's shards 0 to 3
OLMO_QKVG = ("q_proj", "k_proj", "v_proj", "g_proj")


@dataclass(frozen=True)
class LightningPlan:
    """A lightning-attention block proven to compute vLLM's ``MiniMaxText01LinearAttention``
    (analyze/lightning_attention.py), under the attribute the layers' attention has too."""

    module_class: str  # the source's block class, e.g. "MiniMaxLightningAttention"
    attr: str  # the decoder layer's child holding it, e.g. "self_attn"
    fixed: tuple[tuple[str, str], ...] = ()  # (condition, why) each config must meet
    # the block's norm epsilon as code (vLLM's class builds 1e-5; the file's layer takes this)
    norm_eps: str = "1e-06"
    # the layer's own choice: its class (``isinstance(self.<attr>, <attention class>)``)
    layer_test: str = ""
    attention_when: bool = True

    # the block's persistent buffers (its decay tables, computed from the config and the
    # layer's index, which transformers saves): vLLM's class computes its own, proven equal
    buffers: tuple[str, ...] = ()
    # the one of them holding each head's decay rate, loaded into the file's ``slope_rate``
    rates: str = ""

    vllm_dtype = "float32"  # the file's layer runs its recurrence in torch on CPU

    @property
    def checkpoint_suffix_renames(self) -> tuple[tuple[str, str | None], ...]:
        # vLLM's class builds its parts under the checkpoint's names; the tables derived from
        # the rates are skipped
        renames = []
        for name in self.buffers:
            if name != self.rates:
                renames.append((f".{self.attr}.{name}", None))
            elif name != "slope_rate":  # the file's layer keeps them under vLLM's name
                renames.append((f".{self.attr}.{name}", f".{self.attr}.slope_rate"))
        return tuple(renames)


MixerPlan = ShortConvPlan | Mamba2Plan | Mamba1Plan | GatedDeltaNetPlan | LightningPlan
