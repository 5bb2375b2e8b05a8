"""Config of `fusedqkv_postnorm`: a fused-QKV, post-norm test model written as Hub custom code (hfrewrite tests)."""

from transformers import PretrainedConfig


class FusedQKVPostNormConfig(PretrainedConfig):
    model_type = "fusedqkv_postnorm"

    def __init__(
        self,
        vocab_size=256,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        layer_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=0.02,
        use_cache=True,
        tie_word_embeddings=False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.layer_norm_eps = layer_norm_eps
        self.rope_theta = rope_theta
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
