"""The one place that knows the vLLM API the emitted files target.

Passes ask for vLLM names by symbol (``VLLM["QKVParallelLinear"]``); the import each symbol
needs lives here, so following a vLLM API move is a one-line change.
"""

VLLM_VERSION = "0.32"

# symbol -> module it is imported from, in vLLM 0.32
VLLM: dict[str, str] = {
    "support_torch_compile": "vllm.compilation.decorators",
    "CacheConfig": "vllm.config",
    "VllmConfig": "vllm.config",
    "get_current_vllm_config": "vllm.config",
    "get_ep_group": "vllm.distributed",
    "get_pp_group": "vllm.distributed",
    "get_tensor_model_parallel_rank": "vllm.distributed",
    "get_forward_context": "vllm.forward_context",
    "get_tensor_model_parallel_world_size": "vllm.distributed",
    "tensor_model_parallel_all_gather": "vllm.distributed",
    "get_act_and_mul_fn": "vllm.model_executor.layers.activation",
    "Attention": "vllm.model_executor.layers.attention",
    "MLAAttention": "vllm.model_executor.layers.attention",
    "ChunkedLocalAttention": "vllm.model_executor.layers.attention.chunked_local_attention",
    "FusedMoEFactory": "vllm.model_executor.layers.fused_moe",
    "GateLinear": "vllm.model_executor.layers.fused_moe",
    "RMSNorm": "vllm.model_executor.layers.layernorm",
    "GemmaRMSNorm": "vllm.model_executor.layers.layernorm",
    "ColumnParallelLinear": "vllm.model_executor.layers.linear",
    "MergedColumnParallelLinear": "vllm.model_executor.layers.linear",
    "QKVParallelLinear": "vllm.model_executor.layers.linear",
    "ReplicatedLinear": "vllm.model_executor.layers.linear",
    "RowParallelLinear": "vllm.model_executor.layers.linear",
    "LogitsProcessor": "vllm.model_executor.layers.logits_processor",
    "QuantizationConfig": "vllm.model_executor.layers.quantization",
    "RotaryEmbedding": "vllm.model_executor.layers.rotary_embedding",
    "get_rope": "vllm.model_executor.layers.rotary_embedding",
    "ParallelLMHead": "vllm.model_executor.layers.vocab_parallel_embedding",
    "VocabParallelEmbedding": "vllm.model_executor.layers.vocab_parallel_embedding",
    "MambaStateCopyFunc": "vllm.model_executor.layers.mamba.mamba_utils",
    "MambaStateCopyFuncCalculator": "vllm.model_executor.layers.mamba.mamba_utils",
    "MambaStateDtypeCalculator": "vllm.model_executor.layers.mamba.mamba_utils",
    "MambaStateShapeCalculator": "vllm.model_executor.layers.mamba.mamba_utils",
    "is_conv_state_dim_first": "vllm.model_executor.layers.mamba.mamba_utils",
    "MambaMixer": "vllm.model_executor.layers.mamba.mamba_mixer",
    "MiniMaxText01LinearAttention": "vllm.model_executor.layers.mamba.linear.minimax_linear_attn",
    "split_batch_to_prefill_and_decode": "vllm.model_executor.layers.mamba.mamba_mixer",
    "MambaMixer2": "vllm.model_executor.layers.mamba.mamba_mixer2",
    "Mixer2RMSNormGated": "vllm.model_executor.layers.mamba.mamba_mixer2",
    "QwenGatedDeltaNetAttention": "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
    "OlmoHybridGatedDeltaNetAttention": "vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn",
    "olmo_gdn_linear_attn": "vllm.model_executor.layers.mamba.gdn",
    "ShortConv": "vllm.model_executor.layers.mamba.short_conv",
    "causal_conv1d_fn": "vllm.model_executor.layers.mamba.ops.causal_conv1d",
    "causal_conv1d_update": "vllm.model_executor.layers.mamba.ops.causal_conv1d",
    "HasInnerState": "vllm.model_executor.models.interfaces",
    "IsHybrid": "vllm.model_executor.models.interfaces",
    "IsAttentionFree": "vllm.model_executor.models.interfaces",
    "MixtureOfExperts": "vllm.model_executor.models.interfaces",
    "EagleModelMixin": "vllm.model_executor.models.interfaces",
    "SupportsEagle3": "vllm.model_executor.models.interfaces",
    "SupportsLoRA": "vllm.model_executor.models.interfaces",
    "SupportsPP": "vllm.model_executor.models.interfaces",
    "set_weight_attrs": "vllm.model_executor.utils",
    "sharded_weight_loader": "vllm.model_executor.model_loader.weight_utils",
    "AutoWeightsLoader": "vllm.model_executor.models.utils",
    "PPMissingLayer": "vllm.model_executor.models.utils",
    "WeightsMapper": "vllm.model_executor.models.utils",
    "extract_layer_index": "vllm.model_executor.models.utils",
    "make_empty_intermediate_tensors_factory": "vllm.model_executor.models.utils",
    "make_layers": "vllm.model_executor.models.utils",
    "maybe_prefix": "vllm.model_executor.models.utils",
    "current_platform": "vllm.platforms",
    "IntermediateTensors": "vllm.sequence",
}

# Non-vLLM symbols the templates use.
OTHER: dict[str, str] = {
    "Iterable": "collections.abc",
    "islice": "itertools",
    "pairwise": "itertools",
    "replace": "dataclasses",
    "mock": "unittest",
    "PretrainedConfig": "transformers",  # annotates Hub custom code's configuration
}


def import_of(symbol: str) -> tuple[str, str]:
    """(module, name) to import for a symbol a pass emits."""
    module = VLLM.get(symbol) or OTHER.get(symbol)
    if module is None:
        raise KeyError(f"hfrewrite.emit.target does not know where {symbol!r} lives")
    return module, symbol
