"""thread_layer_args: cache_config / quant_config / prefix threaded through layer classes."""

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
    assert (
        'def __init__(self, config, layer_idx, quant_config: QuantizationConfig | None = None, prefix: str = ""):'
        in after
    )
