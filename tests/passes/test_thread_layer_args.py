"""thread_layer_args: cache_config / quant_config / prefix threaded through layer classes."""

import dataclasses

from harness import assert_rewrites, rewrite
from hfrewrite.passes import thread_layer_args
from plans import llama_like

BEFORE_LAYER_CLASSES = """\
class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.down_proj = RowParallelLinear(1, 2, quant_config=quant_config, prefix=f"{prefix}.down_proj")


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = Attention(4, 32, 0.1, cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.attn")


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)


class Helper(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.scale = size
"""

AFTER_LAYER_CLASSES = """\
class LlamaMLP(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        self.down_proj = RowParallelLinear(1, 2, quant_config=quant_config, prefix=f"{prefix}.down_proj")


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx, cache_config: CacheConfig | None = None, quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        self.attn = Attention(4, 32, 0.1, cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.attn")


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx, cache_config: CacheConfig | None = None, quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx, cache_config = cache_config, quant_config = quant_config, prefix = f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config, quant_config = quant_config, prefix = f"{prefix}.mlp")


class Helper(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.scale = size
"""


def test_layer_classes():
    assert_rewrites(thread_layer_args, BEFORE_LAYER_CLASSES, AFTER_LAYER_CLASSES, llama_like())


UNCHANGED_CLASS_WITHOUT_VLLM_LAYERS = """\
class Helper(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.scale = size
"""


def test_leaves_class_without_vllm_layers_unchanged():
    assert (
        rewrite(thread_layer_args, UNCHANGED_CLASS_WITHOUT_VLLM_LAYERS, llama_like())
        == UNCHANGED_CLASS_WITHOUT_VLLM_LAYERS
    )


BEFORE_CHOSEN_CLASS = """\
class SparseMoe(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.experts = FusedMoEFactory(quant_config=quant_config, prefix=f"{prefix}.experts")


class DenseMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.down_proj = RowParallelLinear(1, 2, quant_config=quant_config, prefix=f"{prefix}.down_proj")


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.mlp = SparseMoe(config) if config.mlp_layer_types[layer_idx] == "sparse" else DenseMLP(config)
"""


def test_both_classes_of_a_conditional_construction_get_the_layer_args():
    """hy_v3's dense or sparse MLP: each MoE layer's runner is registered by its prefix,
    so a branch left without one names every layer's runner alike."""
    after = rewrite(thread_layer_args, BEFORE_CHOSEN_CLASS, llama_like())
    assert (
        'self.mlp = SparseMoe(config, quant_config = quant_config, prefix = f"{prefix}.mlp") '
        'if config.mlp_layer_types[layer_idx] == "sparse" '
        'else DenseMLP(config, quant_config = quant_config, prefix = f"{prefix}.mlp")'
    ) in after
    # the decoder layer takes all three, as make_layers builds it (prune_unused_params drops the unread)
    assert (
        "def __init__(self, config, layer_idx, cache_config: CacheConfig | None = None, "
        'quant_config: QuantizationConfig | None = None, prefix: str = ""):'
    ) in after


BEFORE_WRAPPED_TABLE = """\
class SelfAttention(nn.Module):
    def __init__(self, config, attention_type):
        super().__init__()
        self.attn = Attention(4, 32, 1.0, cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.attn")


class FlashSelfAttention(SelfAttention):
    pass


CLASSES = {"eager": SelfAttention, "flash_attention_2": FlashSelfAttention}


class AttentionWrapper(nn.Module):
    def __init__(self, config, layer_id=0):
        super().__init__()
        self.attention_type = config.attention_layers[layer_id]
        if self.attention_type in ["global", "local"]:
            self.attention = CLASSES[config._attn_implementation](config, self.attention_type)
        else:
            raise NotImplementedError("global or local")


class Block(nn.Module):
    def __init__(self, config, layer_id=None):
        super().__init__()
        self.attn = AttentionWrapper(config, layer_id)
"""

AFTER_WRAPPED_TABLE = """\
class SelfAttention(nn.Module):
    def __init__(self, config, attention_type, cache_config: CacheConfig | None = None, quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        self.attn = Attention(4, 32, 1.0, cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.attn")


class FlashSelfAttention(SelfAttention):
    pass


CLASSES = {"eager": SelfAttention, "flash_attention_2": FlashSelfAttention}


class AttentionWrapper(nn.Module):
    def __init__(self, config, layer_id=0, cache_config: CacheConfig | None = None, quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        self.attention_type = config.attention_layers[layer_id]
        if self.attention_type in ["global", "local"]:
            self.attention = SelfAttention(config, self.attention_type, cache_config = cache_config, quant_config = quant_config, prefix = f"{prefix}.attention")
        else:
            raise NotImplementedError("global or local")


class Block(nn.Module):
    def __init__(self, config, layer_id=None, cache_config: CacheConfig | None = None, quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        self.attn = AttentionWrapper(config, layer_id, cache_config = cache_config, quant_config = quant_config, prefix = f"{prefix}.attn")
"""


def test_a_wrapper_choosing_the_attention_from_a_table_under_an_if():
    """GPT-Neo: the block's `attn` wraps the attention, which the wrapper builds from its
    class table inside an `if`: the traced class is built there, and the layer arguments
    reach it through the wrapper and the block."""
    plan = llama_like()
    plan = dataclasses.replace(
        plan,
        attention=dataclasses.replace(plan.attention, module_class="SelfAttention"),
        decoder_layer=dataclasses.replace(
            plan.decoder_layer,
            module_class="Block",
            attention_block="attn.attention",
            attention_wrappers=("AttentionWrapper",),
        ),
    )
    assert_rewrites(thread_layer_args, BEFORE_WRAPPED_TABLE, AFTER_WRAPPED_TABLE, plan)


def test_a_part_built_through_an_alias_chosen_by_literals_is_built_by_its_class():
    """Bamba: ``num_experts = 1``, ``ffn_layer_class = BambaMLP if num_experts == 1 else None``,
    ``self.feed_forward = ffn_layer_class(config)``: the MLP gets its quant_config and prefix."""
    before = """\
class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.down_proj = RowParallelLinear(1, 1, quant_config=quant_config, prefix=f"{prefix}.down_proj")


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        num_experts = 1
        ffn_layer_class = LlamaMLP if num_experts == 1 else None
        self.feed_forward = ffn_layer_class(config)
"""
    out = rewrite(thread_layer_args, before, llama_like())
    assert (
        'self.feed_forward = LlamaMLP(config, quant_config = quant_config, prefix = f"{prefix}.feed_forward")'
        in out
    )
    assert "num_experts" not in out and "ffn_layer_class" not in out


def test_an_alias_read_otherwise_than_called_stays():
    before = """\
class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        kind = 1
        cls = LlamaMLP if kind == 1 else None
        self.kind = cls
"""
    assert rewrite(thread_layer_args, before, llama_like()) == before


_EITHER = """\
class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.down_proj = RowParallelLinear(1, 1, quant_config=quant_config, prefix=f"{prefix}.down_proj")


class LlamaMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.down_proj = RowParallelLinear(1, 1, quant_config=quant_config, prefix=f"{prefix}.down_proj")


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        num_experts = config.layers_num_experts[layer_idx]
        ffn_layer_class = LlamaMoE if num_experts > 1 else LlamaMLP
        self.feed_forward = ffn_layer_class(config)
"""


def test_a_part_built_through_an_alias_chosen_per_layer_is_built_by_either_class():
    """Jamba: ``ffn_layer_class = JambaSparseMoeBlock if num_experts > 1 else JambaMLP`` on the
    layer's own count: each of the two calls gets its quant_config and prefix."""
    out = rewrite(thread_layer_args, _EITHER, llama_like())
    assert (
        'self.feed_forward = LlamaMoE(config, quant_config = quant_config, prefix = f"{prefix}.feed_forward") '
        'if num_experts > 1 else LlamaMLP(config, quant_config = quant_config, prefix = f"{prefix}.feed_forward")'
    ) in out
    assert "ffn_layer_class" not in out


def test_an_alias_of_a_class_the_file_does_not_define_stays():
    before = _EITHER.replace("LlamaMoE if", "Attention if")
    assert "ffn_layer_class(config" in rewrite(thread_layer_args, before, llama_like())


def test_an_alias_whose_test_changes_before_its_call_stays():
    before = _EITHER.replace(
        "        self.feed_forward = ffn_layer_class(config)\n",
        "        num_experts = 1\n        self.feed_forward = ffn_layer_class(config)\n",
    )
    assert "ffn_layer_class(config" in rewrite(thread_layer_args, before, llama_like())
