"""What is benchmarked: workload sizes, the checkpoints' model types and configs, the
variants, and building one model's random checkpoint (in Hugging Face's worker)."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.throughput.progress import err_line, say

if TYPE_CHECKING:
    from benchmarks.throughput.channel import Worker

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Workload:
    """What one timed run decodes, and how often."""

    n_prompts: int = 8
    prompt_len: int = 128
    new_tokens: int = 64
    warmup: int = 1
    reps: int = 3
    startup_reps: int = 4  # eager LLM() builds per variant (first + rebuilds)
    max_reps: int = 7  # more timed runs while a round of all variants is short:
    extra_rep_max_s: float = 12.0  # ... at most this long (wall s)
    max_extra_pairs: int = 6  # generated/native pairs added while not clearly >= 1
    pause_s: float = 0.5  # idle gap between timed runs (other workers' threads settle)


FULL = Workload()
QUICK = Workload(
    n_prompts=4,
    prompt_len=32,
    new_tokens=16,
    reps=2,
    startup_reps=2,
    max_reps=2,
    max_extra_pairs=2,
    pause_s=0.2,
)


@dataclass(frozen=True)
class ModelSpec:
    """One benchmarked checkpoint: a model type, its config and its generated file."""

    key: str
    model_type: str
    config: dict[str, Any]
    quick_config: dict[str, Any]
    golden: str  # golden/<file>: the type is benchmarked only when it exists
    label: str
    # what every variant computes in: bfloat16 where vLLM's CPU kernels take no other (gated
    # delta nets)
    dtype: str = "float32"


def describe(label: str, c: dict[str, Any], dtype: str = "float32") -> str:
    """One line for a checkpoint config."""
    text = (
        f"{label}: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
        f"{c['num_attention_heads']} heads ({c['num_key_value_heads']} kv, head_dim "
        f"{c['head_dim']})"
    )
    experts = c.get("num_experts", c.get("n_routed_experts"))
    if experts:
        text += (
            f", {experts} experts top-{c['num_experts_per_tok']} "
            f"(moe_intermediate {c['moe_intermediate_size']})"
        )
        if "n_group" in c:
            shared = c.get("n_shared_experts", c.get("num_shared_experts"))
            text += f" in {c['n_group']} groups, top-{c['topk_group']} groups, sigmoid, {shared} shared"
    else:
        text += f", intermediate {c.get('intermediate_size', c.get('n_inner'))}"
    if "kv_lora_rank" in c:
        text += (
            f", MLA (latent {c['kv_lora_rank']} + rope {c['qk_rope_head_dim']}, "
            f"q rank {c['q_lora_rank']}, nope {c['qk_nope_head_dim']}, v {c['v_head_dim']})"
        )
    kinds = c.get("layer_types", [])
    if "conv" in kinds:
        text += f", {kinds.count('conv')} of the layers short convolutions"
    if "linear_num_key_heads" in c:
        text += (
            f", gated delta nets ({c['linear_num_key_heads']} key / {c['linear_num_value_heads']} value "
            f"heads of {c['linear_key_head_dim']}) in {kinds.count('linear_attention')} of the layers"
        )
    return text + f", vocab {c['vocab_size']}, {dtype}, random weights"


LLAMA = ModelSpec(
    key="llama",
    model_type="llama",
    config={
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 2816,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
    },
    quick_config={
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "vocab_size": 1024,
        "max_position_embeddings": 256,
    },
    golden="llama.py",
    label="Dense Llama",
)

QWEN3_MOE = ModelSpec(
    key="qwen3_moe",
    model_type="qwen3_moe",
    config={
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 768,
        "intermediate_size": 1536,
        "norm_topk_prob": True,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
    },
    quick_config={
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "intermediate_size": 512,
        "norm_topk_prob": True,
        "vocab_size": 1024,
        "max_position_embeddings": 256,
    },
    golden="qwen3_moe.py",
    label="Qwen3-MoE",
)

_SMALL, _DENSE = LLAMA.quick_config, LLAMA.config  # the dense sizes, reused


def _without(config: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k != key}


# DeepSeek-V3-style routing without MLA: sigmoid scores, a score-correction bias, top-2 of
# 4 expert groups, renormalised and scaled, an ungated shared expert, the first layer dense.
_GROUPED = {
    "n_routed_experts": 16,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
}
GLM4_MOE = ModelSpec(
    key="glm4_moe",
    model_type="glm4_moe",
    config={
        **_without(QWEN3_MOE.config, "num_experts"),
        **_GROUPED,
        "moe_intermediate_size": 384,
    },
    quick_config={
        **_without(QWEN3_MOE.quick_config, "num_experts"),
        **_GROUPED,
        "moe_intermediate_size": 128,
    },
    golden="glm4_moe.py",
    label="GLM-4.5-MoE (grouped sigmoid routing)",
)

# DeepSeek-V3: MLA (the latent sizes vLLM's CPU MLA backend caches: 512 + 64) with the
# grouped sigmoid routing above. vLLM's own file runs on CPU but computes a wrong prefill
# (docs/moe.md): its speed is still the native reference.
_MLA = {
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "q_lora_rank": 192,
    "topk_method": "noaux_tc",
}
DEEPSEEK_V3 = ModelSpec(
    key="deepseek_v3",
    model_type="deepseek_v3",
    config={**_without(GLM4_MOE.config, "head_dim"), **_MLA, "num_key_value_heads": 8},
    quick_config={
        **_without(GLM4_MOE.quick_config, "head_dim"),
        **_MLA,
        "num_key_value_heads": GLM4_MOE.quick_config["num_attention_heads"],
    },
    golden="deepseek_v3.py",
    label="DeepSeek-V3 (MLA, grouped sigmoid routing)",
)

# Sandwich norms, per-head q/k norms, soft caps off in gemma3, sliding and global
# layers with rope per layer type, scaled embeddings: the carried-source layer path.
GEMMA3_TEXT = ModelSpec(
    key="gemma3_text",
    model_type="gemma3_text",
    config={
        **_DENSE,
        "tie_word_embeddings": False,
        "sliding_window": 512,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2,
    },
    quick_config={
        **_SMALL,
        "tie_word_embeddings": False,
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    golden="gemma3_text.py",
    label="Gemma3 (text)",
)

# A parallel attention + MLP block off one LayerNorm, partial rope, an ungated MLP and an
# lm_head bias: the carried-source layer path with LayerNorms kept from the source.
PHI = ModelSpec(
    key="phi",
    model_type="phi",
    config={**_DENSE, "num_key_value_heads": 16, "intermediate_size": 4096},
    quick_config={**_SMALL, "num_key_value_heads": 4},
    golden="phi.py",
    label="Phi",
)

# StarCoder's shape: learned absolute position embeddings, multi-query attention fused in one
# c_attn, LayerNorms, an ungated gelu MLP (the carried-source layer path).
GPT_BIGCODE = ModelSpec(
    key="gpt_bigcode",
    model_type="gpt_bigcode",
    config={**_without(_DENSE, "intermediate_size"), "num_key_value_heads": 1, "n_inner": 4096},
    quick_config={**_without(_SMALL, "intermediate_size"), "num_key_value_heads": 1, "n_inner": 1024},
    golden="gpt_bigcode.py",
    label="GPT-BigCode (StarCoder: learned positions, multi-query attention)",
)

# A hybrid: LFM2's gated short-convolution layers (vLLM's ShortConv, a convolution state
# cache) between attention layers, in the released order (two conv layers, then attention).
# conv_dim and block_dim: the Hub config's fields vLLM's own lfm2.py reads.
_LFM2 = {"block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0, "conv_L_cache": 3}
LFM2 = ModelSpec(
    key="lfm2",
    model_type="lfm2",
    config={
        **_DENSE,
        **_LFM2,
        "conv_dim": _DENSE["hidden_size"],
        "block_dim": _DENSE["hidden_size"],
        "layer_types": ["conv", "conv", "full_attention"] * 2 + ["conv", "full_attention"],
    },
    quick_config={
        **_SMALL,
        **_LFM2,
        "conv_dim": _SMALL["hidden_size"],
        "block_dim": _SMALL["hidden_size"],
        "layer_types": ["conv", "full_attention"],
    },
    golden="lfm2.py",
    label="LFM2 (hybrid: short convolutions and attention)",
)

# A Mamba-2 hybrid: Granite-4.0-H's Mamba-2 layers (vLLM's MambaMixer2, convolution and
# recurrent states cached) around two attention layers without rope, each layer a MoE block
# beside a shared MLP, muP multipliers on embeddings, residuals, attention and logits.
_GRANITE_H = {
    "position_embedding_type": "nope",
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "mamba_n_groups": 1,
    "mamba_d_state": 64,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "attention_multiplier": 0.015625,
    "logits_scaling": 6.0,
}
GRANITE_H = ModelSpec(
    key="granitemoehybrid",
    model_type="granitemoehybrid",
    config={
        **_without(_DENSE, "intermediate_size"),
        **_GRANITE_H,
        "intermediate_size": 512,
        "shared_intermediate_size": 1024,
        "mamba_n_heads": 32,
        "mamba_d_head": 64,
        "layer_types": ["linear_attention"] * 3
        + ["full_attention"]
        + ["linear_attention"] * 3
        + ["full_attention"],
    },
    quick_config={
        **_without(_SMALL, "intermediate_size"),
        **_GRANITE_H,
        "intermediate_size": 128,
        "shared_intermediate_size": 256,
        "mamba_n_heads": 8,
        "mamba_d_head": 64,
        "layer_types": ["linear_attention", "full_attention"],
    },
    golden="granitemoehybrid.py",
    label="Granite-4.0-H (hybrid: Mamba-2, attention without rope, MoE beside a shared MLP)",
)

# AFMoE (Arcee's Trinity): attention gated by sigmoid(gate_proj(x)), rope on the sliding
# layers only, sandwich norms, a dense first layer, then sigmoid routing with a correction
# bias, scaled, beside a shared expert. The routing fields are the Hub config's, read by
# vLLM's own afmoe.py.
_AFMOE = {
    "num_dense_layers": 1,
    "num_shared_experts": 1,
    "route_scale": 2.5,
    "score_func": "sigmoid",
    "route_norm": True,
    "n_group": 1,
    "topk_group": 1,
    "global_attn_every_n_layers": 2,
}
AFMOE = ModelSpec(
    key="afmoe",
    model_type="afmoe",
    config={**QWEN3_MOE.config, **_AFMOE, "sliding_window": 128},
    quick_config={**QWEN3_MOE.quick_config, **_AFMOE, "sliding_window": 32},
    golden="afmoe.py",
    label="AFMoE (gated attention, sigmoid routing, shared expert)",
)

# A gated-delta-net hybrid: Qwen3-Next's linear-attention layers (vLLM's
# QwenGatedDeltaNetAttention, convolution and recurrent states cached) in three of every four
# layers, attention gated by half of q_proj with partial rope, MoE beside a gated shared
# expert. vLLM's CPU kernel of gated delta nets computes in bfloat16 only: every variant runs
# in bfloat16 (its heads 128 wide, as released, which the kernel takes).
_QWEN3_NEXT = {
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "partial_rotary_factor": 0.25,
}
QWEN3_NEXT = ModelSpec(
    key="qwen3_next",
    model_type="qwen3_next",
    config={
        **_DENSE,
        **_QWEN3_NEXT,
        "head_dim": 128,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
    },
    quick_config={
        **_SMALL,
        **_QWEN3_NEXT,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
    },
    golden="qwen3_next.py",
    label="Qwen3-Next (hybrid: gated delta nets, gated attention, MoE beside a gated shared expert)",
    dtype="bfloat16",
)

# A parallel hybrid: Falcon-H1's attention and Mamba-2 side by side in every layer (vLLM's
# Attention and MambaMixer2, the mixer's states cached), muP multipliers of their own on the
# embeddings, the mixer's input and projection columns, the keys, both outputs, the MLP and
# the logits.
_FALCON_H1 = {
    "mamba_d_head": 64,
    "mamba_d_state": 64,
    "key_multiplier": 0.39,
    "attention_out_multiplier": 0.94,
    "ssm_in_multiplier": 1.25,
    "ssm_out_multiplier": 0.23,
    "ssm_multipliers": [0.35, 0.25, 0.5, 0.35, 0.17],
    "mlp_multipliers": [0.88, 0.5],
    "embedding_multiplier": 5.66,
    "lm_head_multiplier": 0.039,
}
FALCON_H1 = ModelSpec(
    key="falcon_h1",
    model_type="falcon_h1",
    config={**_DENSE, **_FALCON_H1, "mamba_n_heads": 24, "mamba_d_ssm": 1536},
    quick_config={**_SMALL, **_FALCON_H1, "mamba_n_heads": 4, "mamba_d_ssm": 256},
    golden="falcon_h1.py",
    label="Falcon-H1 (hybrid: attention and Mamba-2 side by side in every layer, muP multipliers)",
)

# Layers of one block each (NemotronH): Mamba-2, attention without rope or a relu² MLP by layer,
# in the released order's proportions (half the layers MLPs, most of the others Mamba-2).
_NEMOTRON_H = {"mamba_head_dim": 64, "ssm_state_size": 64, "n_groups": 8, "mlp_hidden_act": "relu2"}
NEMOTRON_H = ModelSpec(
    key="nemotron_h",
    model_type="nemotron_h",
    config={
        **_DENSE,
        **_NEMOTRON_H,
        "mamba_num_heads": 32,
        "num_hidden_layers": 16,
        "layers_block_type": ["linear_attention", "mlp", "linear_attention", "mlp", "full_attention", "mlp"]
        + ["linear_attention", "mlp"] * 5,
    },
    quick_config={
        **_SMALL,
        **_NEMOTRON_H,
        "n_groups": 2,
        "mamba_num_heads": 8,
        "num_hidden_layers": 3,
        "layers_block_type": ["linear_attention", "full_attention", "mlp"],
    },
    golden="nemotron_h.py",
    label="NemotronH (hybrid: one block per layer, Mamba-2 with floored time steps, attention or MLP)",
)

MODELS = (
    LLAMA,
    QWEN3_MOE,
    GEMMA3_TEXT,
    PHI,
    GLM4_MOE,
    DEEPSEEK_V3,
    GPT_BIGCODE,
    LFM2,
    GRANITE_H,
    AFMOE,
    QWEN3_NEXT,
    FALCON_H1,
    NEMOTRON_H,
)
VLLM_VARIANTS = ("generated", "native", "transformers")
VARIANTS = (*VLLM_VARIANTS, "hf")
LABELS = {
    "generated": "generated file (vLLM)",
    "native": "vLLM native",
    "transformers": "vLLM Transformers backend",
    "hf": "Hugging Face generate",
}


def make_prompts(workload: Workload, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``n_prompts`` prompts of ``prompt_len`` random token ids (deterministic)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab_size) for _ in range(workload.prompt_len)] for _ in range(workload.n_prompts)
    ]


def golden_types(golden_dir: Path) -> list[str]:
    """Model types of the generated files in golden/ (from their hfrewrite-source line)."""
    types = []
    for path in sorted(golden_dir.glob("*.py")):
        m = re.search(r"^# hfrewrite-source: (\{.*\})$", path.read_text(), re.MULTILINE)
        if m:
            types.append(json.loads(m.group(1))["model"])
    return types


def prepare_model(
    spec: ModelSpec,
    generated_module: Path,
    workload: Workload,
    tmp: Path,
    workers: dict[str, Worker],
    quick: bool,
) -> dict[str, Any]:
    """Build one model's random checkpoint (in Hugging Face's worker, which never runs
    vLLM); return its results dict with what the modes need to load it."""
    config = spec.quick_config if quick else spec.config
    ckpt = tmp / f"ckpt-{spec.key}"
    res: dict[str, Any] = {
        "description": describe(spec.label, config, spec.dtype),
        "model_type": spec.model_type,
        "config": config,
        "generated_module": str(generated_module),
        "modes": {},
    }
    made = workers["hf"].call(
        "make_checkpoint",
        900,
        model_type=spec.model_type,
        out_dir=str(ckpt),
        config=config,
    )
    if "error" in made:
        res["error"] = f"checkpoint: {err_line(made)}"
        return res
    res["architecture"] = made["architecture"]
    res["checkpoint_s"] = made["seconds"]
    say(f"{spec.key}: checkpoint {res['architecture']} built in {made['seconds']:.1f} s")
    res["_load_args"] = {
        "ckpt": str(ckpt),
        "architecture": res["architecture"],
        "max_model_len": workload.prompt_len + workload.new_tokens + 16,
        "generated_module": str(generated_module),
        "dtype": spec.dtype,
    }
    res["_prompts"] = make_prompts(workload, config["vocab_size"])
    return res
