"""Hand-written plans for pass tests (what analysis finds for tiny llama/qwen3 configs)."""

from hfrewrite.analyze.norm_kinds import NormKind
from hfrewrite.analyze.plan import (
    AttentionPlan,
    DecoderLayerPlan,
    LinearFact,
    MlpPlan,
    ModelPlan,
    NormPlan,
    ResidualBlock,
)
from hfrewrite.analyze.rope_styles import RopeLayers
from hfrewrite.analyze.router_scorings import Scoring


def llama_like(
    prefix: str = "Llama",
    model_type: str = "llama",
    qk_norm: bool = False,
    qkv_bias: bool = False,
) -> ModelPlan:
    return ModelPlan(
        model_type=model_type,
        architecture=f"{prefix}ForCausalLM",
        base_model_class=f"{prefix}Model",
        base_model_attr="model",
        embed_tokens="embed_tokens",
        layers="layers",
        final_norm="norm",
        lm_head="lm_head",
        tie_word_embeddings=False,
        head_tied_to="model.embed_tokens",  # what the analysis finds for llama, built tied
        decoder_layer=DecoderLayerPlan(
            f"{prefix}DecoderLayer",
            (
                ResidualBlock("input_layernorm", "self_attn"),
                ResidualBlock("post_attention_layernorm", "mlp"),
            ),
        ),
        attention=AttentionPlan(
            module_class=f"{prefix}Attention",
            q=LinearFact("q_proj", 128, 128, qkv_bias),
            k=LinearFact("k_proj", 128, 64, qkv_bias),
            v=LinearFact("v_proj", 128, 64, qkv_bias),
            o=LinearFact("o_proj", 128, 128, False),
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            q_norm="q_norm" if qk_norm else None,
            k_norm="k_norm" if qk_norm else None,
            rope_layers=RopeLayers.ALL,
            scaling=32**-0.5,
            sliding_window=None,
            # what the analysis finds llama's forward calls compute: the rope, nothing else
            replaced_calls=("apply_rotary_pos_emb",),
        ),
        mlp=MlpPlan(
            module_class=f"{prefix}MLP",
            gate=LinearFact("gate_proj", 128, 256, False),
            up=LinearFact("up_proj", 128, 256, False),
            down=LinearFact("down_proj", 256, 128, False),
            act_attr="act_fn",
            activation="silu",
        ),
        norm=NormPlan(f"{prefix}RMSNorm", NormKind.RMS, 1e-6),
    )


def qwen_moe(shared: bool = False) -> ModelPlan:
    """A qwen2/3-MoE-like plan: MoE blocks, an optional shared expert of the MLP class."""
    import dataclasses

    from hfrewrite.analyze.plan import MoePlan

    moe = MoePlan(
        module_class="MoeBlock",
        router="gate",
        router_class="TopKRouter",
        experts="experts",
        experts_class="Experts",
        num_experts=8,
        top_k=2,
        scoring=Scoring.SOFTMAX,
        renormalize=True,
        activation="silu",
        shared_expert="shared_expert" if shared else None,
        shared_expert_gate="shared_expert_gate" if shared else None,
    )
    return dataclasses.replace(llama_like("Qwen3Moe", "qwen3_moe"), moe=moe)
