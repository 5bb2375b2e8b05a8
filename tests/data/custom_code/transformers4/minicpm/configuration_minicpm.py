# coding=utf-8
# Tiny test copy, in the style of openbmb/MiniCPM-2B's Hub `configuration_minicpm.py` (derived from
# transformers' LlamaConfig of the 4.36 era). Written for the hfrewrite tests; not the original file.
"""MiniCPM model configuration"""

from transformers.configuration_utils import PretrainedConfig
from transformers.utils import logging


logger = logging.get_logger(__name__)

MINICPM_PRETRAINED_CONFIG_ARCHIVE_MAP = {}


class MiniCPMConfig(PretrainedConfig):
    r"""
    Configuration of a [`MiniCPMModel`]: the Llama fields plus MiniCPM's three muP-style scales.

    Args:
        vocab_size (`int`, *optional*, defaults to 32000): vocabulary size.
        hidden_size (`int`, *optional*, defaults to 4096): width of the residual stream.
        intermediate_size (`int`, *optional*, defaults to 11008): width of the gated MLP.
        num_hidden_layers (`int`, *optional*, defaults to 32): number of decoder layers.
        num_attention_heads (`int`, *optional*, defaults to 32): number of query heads.
        num_key_value_heads (`int`, *optional*): number of key/value heads; defaults to `num_attention_heads`.
        hidden_act (`str`, *optional*, defaults to `"silu"`): MLP activation.
        max_position_embeddings (`int`, *optional*, defaults to 2048): length of the precomputed rotary cache.
        initializer_range (`float`, *optional*, defaults to 0.02): std of the weight initialiser.
        rms_norm_eps (`float`, *optional*, defaults to 1e-6): epsilon of the RMS norms.
        pretraining_tp (`int`, *optional*, defaults to 1): tensor-parallel rank used in pretraining (unused here).
        tie_word_embeddings (`bool`, *optional*, defaults to `True`): lm_head shares the embedding matrix.
        rope_theta (`float`, *optional*, defaults to 10000.0): rotary base.
        rope_scaling (`Dict`, *optional*): `{"type": "linear" | "dynamic", "factor": float > 1}`.
        attention_bias (`bool`, *optional*, defaults to `False`): bias on q/k/v/o projections.
        attention_dropout (`float`, *optional*, defaults to 0.0): dropout on attention probabilities.
        scale_emb (`float`, *optional*, defaults to 1): embeddings are multiplied by this.
        dim_model_base (`int`, *optional*, defaults to 1): hidden states are divided by
            `hidden_size / dim_model_base` before `lm_head`.
        scale_depth (`float`, *optional*, defaults to 1): each residual branch is multiplied by
            `scale_depth / sqrt(num_hidden_layers)`.
    """

    model_type = "minicpm"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=None,
        hidden_act="silu",
        max_position_embeddings=2048,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
        pretraining_tp=1,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rope_scaling=None,
        attention_bias=False,
        attention_dropout=0.0,
        scale_emb=1,
        dim_model_base=1,
        scale_depth=1,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads

        # for backward compatibility
        if num_key_value_heads is None:
            num_key_value_heads = num_attention_heads

        self.num_key_value_heads = num_key_value_heads
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.pretraining_tp = pretraining_tp
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self._rope_scaling_validation()
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.scale_emb = scale_emb
        self.dim_model_base = dim_model_base
        self.scale_depth = scale_depth

        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def _rope_scaling_validation(self):
        """
        Validate the `rope_scaling` configuration.
        """
        if self.rope_scaling is None:
            return

        if not isinstance(self.rope_scaling, dict) or len(self.rope_scaling) != 2:
            raise ValueError(
                "`rope_scaling` must be a dictionary with with two fields, `type` and `factor`, "
                f"got {self.rope_scaling}"
            )
        rope_scaling_type = self.rope_scaling.get("type", None)
        rope_scaling_factor = self.rope_scaling.get("factor", None)
        if rope_scaling_type is None or rope_scaling_type not in ["linear", "dynamic"]:
            raise ValueError(
                f"`rope_scaling`'s type field must be one of ['linear', 'dynamic'], got {rope_scaling_type}"
            )
        if (
            rope_scaling_factor is None
            or not isinstance(rope_scaling_factor, float)
            or rope_scaling_factor <= 1.0
        ):
            raise ValueError(f"`rope_scaling`'s factor field must be a float > 1, got {rope_scaling_factor}")
