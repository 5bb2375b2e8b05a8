# coding=utf-8
# Tiny test copy, in the style of Tele-AI/telechat-7B's Hub `configuration_telechat.py` (itself derived from
# transformers' BloomConfig). Written for the hfrewrite tests; not the original file.
"""Telechat configuration"""

from transformers.configuration_utils import PretrainedConfig
from transformers.utils import logging


logger = logging.get_logger(__name__)


class TelechatConfig(PretrainedConfig):
    """
    Args:
        vocab_size (`int`, *optional*, defaults to 160256): vocabulary size.
        hidden_size (`int`, *optional*, defaults to 4096): width of the residual stream.
        n_layer (`int`, *optional*, defaults to 30): number of blocks.
        n_head (`int`, *optional*, defaults to 32): number of attention heads (keys/values have as many).
        layer_norm_epsilon (`float`, *optional*, defaults to 1e-5): epsilon of the RMS norms.
        initializer_range (`float`, *optional*, defaults to 0.02): std of the weight initialiser.
        apply_residual_connection_post_layernorm (`bool`, *optional*, defaults to `False`): take the residual
            from the normed hidden states instead of the block input.
        hidden_dropout (`float`, *optional*, defaults to 0.0): dropout before each residual add.
        attention_dropout (`float`, *optional*, defaults to 0.0): dropout on attention probabilities.
        ffn_hidden_size (`int`, *optional*, defaults to 12288): width of the SwiGLU MLP.
        training_seqlen (`int`, *optional*, defaults to 8192): training context; at inference the rotary
            table is built for at least this many positions, with NTK / mscale adjustments derived from it.
        logn (`bool`, *optional*, defaults to `True`): log-n attention flag (kept for config compatibility).
        embed_layernorm (`bool`, *optional*, defaults to `False`): RMS-norm the word embeddings.
    """

    model_type = "telechat"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {
        "num_hidden_layers": "n_layer",
        "num_attention_heads": "n_head",
    }

    def __init__(
        self,
        vocab_size=160256,
        hidden_size=4096,
        n_layer=30,
        n_head=32,
        layer_norm_epsilon=1e-5,
        initializer_range=0.02,
        use_cache=True,
        bos_token_id=1,
        eos_token_id=2,
        apply_residual_connection_post_layernorm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        ffn_hidden_size=12288,
        training_seqlen=8192,
        logn=True,
        embed_layernorm=False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        # Backward compatibility with n_embed kwarg
        n_embed = kwargs.pop("n_embed", None)
        self.hidden_size = hidden_size if n_embed is None else n_embed
        self.n_layer = n_layer
        self.n_head = n_head
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.apply_residual_connection_post_layernorm = apply_residual_connection_post_layernorm
        self.hidden_dropout = hidden_dropout
        self.attention_dropout = attention_dropout
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.logn = logn
        self.ffn_hidden_size = ffn_hidden_size
        self.training_seqlen = training_seqlen
        self.embed_layernorm = embed_layernorm

        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)
