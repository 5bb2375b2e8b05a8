# coding=utf-8
# Tiny test copy, in the style of stabilityai/stablelm-3b-4e1t's Hub `configuration_stablelm_epoch.py`.
# Written for the hfrewrite tests; not the original file.
"""StableLM Epoch model configuration"""

from transformers import PretrainedConfig
from transformers.utils import logging


logger = logging.get_logger(__name__)


class StableLMEpochConfig(PretrainedConfig):
    r"""
    Args:
        vocab_size (`int`, *optional*, defaults to 50_304): vocabulary size.
        intermediate_size (`int`, *optional*, defaults to 6912): width of the SwiGLU MLP.
        hidden_size (`int`, *optional*, defaults to 2560): width of the residual stream.
        num_hidden_layers (`int`, *optional*, defaults to 32): number of decoder layers.
        num_attention_heads (`int`, *optional*, defaults to 32): number of query heads.
        num_key_value_heads (`int`, *optional*, defaults to 32): number of key/value heads (GQA when smaller).
        hidden_act (`str`, *optional*, defaults to `"silu"`): MLP activation.
        rope_pct (`float`, *optional*, defaults to 0.25): fraction of each head's channels that get rotary embeddings.
        rope_theta (`float`, *optional*, defaults to 10000): rotary base.
        max_position_embeddings (`int`, *optional*, defaults to 4096): length of the precomputed rotary cache.
        initializer_range (`float`, *optional*, defaults to 0.02): std of the weight initialiser.
        norm_eps (`float`, *optional*, defaults to 1e-5): epsilon of the LayerNorms.
        use_cache (`bool`, *optional*, defaults to `True`): return past key/values.
        use_qkv_bias (`bool`, *optional*, defaults to `False`): bias on q/k/v projections.
        tie_word_embeddings (`bool`, *optional*, defaults to `False`): tie lm_head to the embedding.
        attention_dropout (`float`, *optional*, defaults to 0.0): dropout on attention probabilities.
    """

    model_type = "stablelm_epoch"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 50_304,
        intermediate_size: int = 6912,
        hidden_size: int = 2560,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 32,
        hidden_act: str = "silu",
        rope_pct: float = 0.25,
        rope_theta: float = 10_000,
        max_position_embeddings: int = 4096,
        initializer_range: float = 0.02,
        norm_eps: float = 1.0e-5,
        use_cache: bool = True,
        use_qkv_bias: bool = False,
        bos_token_id: int = 0,
        eos_token_id: int = 2,
        tie_word_embeddings: bool = False,
        attention_dropout: float = 0.0,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings
        self.intermediate_size = intermediate_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.hidden_act = hidden_act
        self.rope_pct = rope_pct
        self.rope_theta = rope_theta
        self.initializer_range = initializer_range
        self.norm_eps = norm_eps
        self.use_cache = use_cache
        self.use_qkv_bias = use_qkv_bias
        self.tie_word_embeddings = tie_word_embeddings
        self.attention_dropout = attention_dropout
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
