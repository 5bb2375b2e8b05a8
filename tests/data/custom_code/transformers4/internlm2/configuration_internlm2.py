# coding=utf-8
# Tiny test copy, in the style of InternLM2's Hub `configuration_internlm2.py` (itself derived from
# transformers' LlamaConfig). Written for the hfrewrite tests; not the original file.
"""InternLM2 model configuration"""

from transformers.configuration_utils import PretrainedConfig
from transformers.utils import logging

logger = logging.get_logger(__name__)

INTERNLM2_PRETRAINED_CONFIG_ARCHIVE_MAP = {}


# Modified from transformers.model.llama.configuration_llama.LlamaConfig
class InternLM2Config(PretrainedConfig):
    r"""
    Configuration of an [`InternLM2Model`]. The defaults give a configuration similar to InternLM2-7B.

    Args:
        vocab_size (`int`, *optional*, defaults to 103168): vocabulary size.
        hidden_size (`int`, *optional*, defaults to 4096): dimension of the hidden representations.
        intermediate_size (`int`, *optional*, defaults to 11008): dimension of the MLP representations.
        num_hidden_layers (`int`, *optional*, defaults to 32): number of decoder layers.
        num_attention_heads (`int`, *optional*, defaults to 32): number of query heads.
        num_key_value_heads (`int`, *optional*): number of key/value heads (GQA); defaults to
            `num_attention_heads`.
        hidden_act (`str`, *optional*, defaults to `"silu"`): activation of the gated MLP.
        max_position_embeddings (`int`, *optional*, defaults to 2048): longest sequence the rotary cache is built for.
        rms_norm_eps (`float`, *optional*, defaults to 1e-6): epsilon of the RMS norms.
        bias (`bool`, *optional*, defaults to `True`): whether `wqkv` and `wo` carry a bias.
        rope_theta (`float`, *optional*, defaults to 10000): rotary base.
        rope_scaling (`dict`, *optional*): `{"type": "linear" | "dynamic", "factor": float >= 1}`.
        attn_implementation (`str`, *optional*, defaults to `"eager"`): `"eager"` or `"flash_attention_2"`.
    """

    model_type = "internlm2"
    _auto_class = "AutoConfig"

    def __init__(  # pylint: disable=W0102
        self,
        vocab_size=103168,
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
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        bias=True,
        rope_theta=10000,
        rope_scaling=None,
        attn_implementation="eager",
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.bias = bias

        if num_key_value_heads is None:
            num_key_value_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads

        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self._rope_scaling_validation()

        self.attn_implementation = attn_implementation
        if self.attn_implementation is None:
            self.attn_implementation = "eager"
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
            or not isinstance(rope_scaling_factor, (float, int))
            or rope_scaling_factor < 1.0
        ):
            raise ValueError(
                f"`rope_scaling`'s factor field must be a number >= 1, got {rope_scaling_factor} "
                f"of type {type(rope_scaling_factor)}"
            )
