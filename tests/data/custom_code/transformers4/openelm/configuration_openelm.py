# Tiny test copy, in the style of Apple's OpenELM Hub `configuration_openelm.py`.
# Written for the hfrewrite tests; not the original file.

from numbers import Number

import numpy as np
from transformers import PretrainedConfig


def make_divisible(v, divisor=8, min_value=None):
    """``v`` rounded to a multiple of ``divisor`` (at least ``min_value``), never more than
    10% below ``v``."""
    if min_value is None:
        min_value = divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


def per_layer(multipliers, num_layers):
    """One multiplier per layer: a number repeated, or two ends interpolated linearly."""
    if isinstance(multipliers, Number):
        return [multipliers] * num_layers
    if len(multipliers) == 2:
        return [round(v, 2) for v in np.linspace(multipliers[0], multipliers[1], num=num_layers, dtype=float)]
    return list(multipliers)  # one per layer already


class OpenELMConfig(PretrainedConfig):
    model_type = "openelm"

    def __init__(
        self,
        vocab_size=32000,
        max_context_length=2048,
        num_transformer_layers=12,
        model_dim=2048,
        head_dim=128,
        qkv_multipliers=1.0,
        num_query_heads=None,
        num_gqa_groups=1,
        ffn_multipliers=4.0,
        ffn_with_glu=True,
        ffn_dim_divisor=256,
        activation_fn_name="swish",
        normalization_layer_name="rms_norm",
        normalize_qk_projections=False,
        share_input_output_layers=False,
        rope_freq_constant=10000,
        rope_max_length=4096,
        initializer_range=0.02,
        use_cache=True,
        bos_token_id=1,
        eos_token_id=2,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.max_context_length = max_context_length
        self.num_transformer_layers = num_transformer_layers
        self.model_dim = model_dim
        self.head_dim = head_dim
        self.qkv_multipliers = qkv_multipliers
        self.num_query_heads = num_query_heads
        self.num_gqa_groups = num_gqa_groups
        self.ffn_multipliers = ffn_multipliers
        self.ffn_with_glu = ffn_with_glu
        self.ffn_dim_divisor = ffn_dim_divisor
        self.activation_fn_name = activation_fn_name
        self.normalization_layer_name = normalization_layer_name
        self.normalize_qk_projections = normalize_qk_projections
        self.share_input_output_layers = share_input_output_layers
        self.rope_freq_constant = rope_freq_constant
        self.rope_max_length = rope_max_length
        self.initializer_range = initializer_range
        self.__post_init__()
        super().__init__(use_cache=use_cache, bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)

    def __post_init__(self):
        # layer-wise scaling: each layer's head count and MLP width from its multiplier
        head_multiple_of = self.num_gqa_groups if self.num_gqa_groups is not None else 2
        qkv = per_layer(self.qkv_multipliers, self.num_transformer_layers)
        self.num_query_heads = [
            int(make_divisible(self.model_dim * m, divisor=self.head_dim * head_multiple_of)) // self.head_dim
            for m in qkv
        ]
        self.num_kv_heads = [q_heads // self.num_gqa_groups for q_heads in self.num_query_heads]
        self.ffn_multipliers = per_layer(self.ffn_multipliers, self.num_transformer_layers)
