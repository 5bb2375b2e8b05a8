"""The MoE goldens, proved in real vLLM: qwen3_moe, mixtral, qwen2_moe, olmoe, glm4_moe, dots1,
granitemoe(shared), flex_olmo, hunyuan_v1_moe, ernie4_5_moe, phimoe, dbrx, gpt_oss, minimax_m2,
hy_v3, exaone_moe, aria_text, cohere2_moe, afmoe, laguna, granitemoe_swa, mellum.

Tiny float32 checkpoints (8 experts, top-2, head_dim 32): greedy tokens equal Hugging Face's
and vLLM native's, chosen-token logprobs within 1e-4. Checkpoints come in the Hub's
per-expert layout (what `save_pretrained` writes in transformers 5.19, e.g. mixtral's
`block_sparse_moe.experts.N.w1`) and, for one case, restacked into the fused 3-D layout
(`experts.gate_up_proj` [E, 2I, H]). Structure: every MoE layer holds one fused-MoE runner
and one router, no plain nn.Linear; the emitted MoE forward has no Python loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hfrewrite.verify.compare import LOGPROB_TOL, VerifyCase, verify_many
from hfrewrite.verify.fixtures import make_tiny_checkpoint

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
QWEN_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
ERNIE = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "moe_layer_start_index": 1,
}
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

CASES: dict[str, tuple[str, dict]] = {
    "qwen3_moe-renormalized": ("qwen3_moe", {**QWEN_MOE, "norm_topk_prob": True}),
    "qwen3_moe-not-renormalized-tied": (
        "qwen3_moe",
        {**QWEN_MOE, "norm_topk_prob": False, "tie_word_embeddings": True},
    ),
    "qwen3_moe-fused-3d-checkpoint": (
        "qwen3_moe",
        {**QWEN_MOE, "norm_topk_prob": True},
    ),
    "mixtral": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen2_moe-shared-expert-mixed-dense": (
        "qwen2_moe",
        {
            **QWEN_MOE,
            "shared_expert_intermediate_size": 128,
            "mlp_only_layers": [1],
            "num_hidden_layers": 3,
        },
    ),
    # olmoe: q/k norms over all heads, config-switched clip_qkv carried from the source.
    "olmoe": ("olmoe", {"num_experts": 8, "num_experts_per_tok": 2}),
    "olmoe-clip-qkv": (
        "olmoe",
        {"num_experts": 8, "num_experts_per_tok": 2, "clip_qkv": 0.5},
    ),
    # DeepSeek-style routing: sigmoid scores, a (random) score-correction bias that steers the
    # choice only, top-2 of 4 expert groups, renormalised and scaled, an ungated shared
    # expert, the first layer dense.
    "glm4_moe-grouped-sigmoid": ("glm4_moe", GROUPED),
    "glm4_moe-fused-3d-checkpoint": ("glm4_moe", {**GROUPED, "norm_topk_prob": False}),
    "dots1-grouped-sigmoid": ("dots1", {**GROUPED, "n_shared_experts": 2}),
    # granitemoe: a softmax over the top-k logits (a renormalised softmax), checkpoint-fused
    # experts (`input_linear` [E, 2I, H]) and residual multipliers in a carried layer forward.
    "granitemoe": ("granitemoe", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    # ... plus a shared MLP in the layer (carried as the source's two nn.Linear).
    "granitemoeshared": (
        "granitemoeshared",
        {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 64,
        },
    ),
    # granitemoe_swa: granitemoeshared's block with per-layer rope bases (`layer_rope_theta`,
    # 0: no rope), attention sinks and sliding windows of 8 on some layers; its shared MLP
    # is vLLM's MergedColumnParallelLinear + RowParallelLinear (its golden traced one)
    "granitemoe_swa-rope-base-per-layer": (
        "granitemoe_swa",
        {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 64,
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
            "layer_rope_theta": [0.0, 10000.0, 500000.0, 0.0],
            "attention_multiplier": 0.125,
        },
    ),
    # ... and without the shared MLP (its size 0: the layer's own `if` skips it)
    "granitemoe_swa-no-shared-mlp": (
        "granitemoe_swa",
        {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 0,
            "layer_rope_theta": [10000.0, 0.0],
            "attention_multiplier": 0.125,
        },
    ),
    # flex_olmo: olmoe's routing in a post-norm layer (carried forward).
    "flex_olmo": ("flex_olmo", {"num_experts": 8, "num_experts_per_tok": 2}),
    # hunyuan_v1_moe: a float32 nn.Linear router inside the gate module (`gate.wg`), a shared MLP.
    "hunyuan_v1_moe": ("hunyuan_v1_moe", {"num_experts": 8, "moe_topk": 2}),
    # ernie4_5_moe: softmax scores with a (random) correction bias held as [1, E] in a child of
    # the router, an optional shared expert (with and without), the first layer dense.
    "ernie4_5_moe-correction-bias-shared": (
        "ernie4_5_moe",
        {**ERNIE, "moe_num_shared_experts": 1},
    ),
    "ernie4_5_moe-correction-bias": (
        "ernie4_5_moe",
        {**ERNIE, "moe_num_shared_experts": 0},
    ),
    # phimoe: sparsemixer routing, which no runner option expresses: the source's router (an
    # nn.Linear subclass) runs as it is, handed to the runner as its custom routing function.
    "phimoe-carried-router": (
        "phimoe",
        {"num_local_experts": 8, "num_experts_per_tok": 2},
    ),
    # dbrx: attention inside a wrapper module (norm_attn_norm), a clip_qkv clamp on the fused
    # Wqkv output before its split, experts as flat [E * I, H] parameters (w1, v1, w2
    # transposed) loaded one expert at a time, routing weights divided by their L1 norm.
    # clip_qkv 2.0 clamps a good share of this checkpoint's q/k/v values.
    "dbrx-clip-qkv": (
        "dbrx",
        {
            "d_model": 128,  # DbrxConfig copies it into ffn_config (hidden_size maps onto it later)
            "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 2.0},
            "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 8, "moe_top_k": 2},
        },
    ),
    # gpt_oss: attention sinks (one logit per head, vLLM's Attention(sinks=...)), a rope helper
    # that splits heads with torch.chunk, sliding and full layers, a biased router whose
    # softmax runs over the top-k logits, stacked experts transposed with gate and up
    # interleaved and biases, the clamped swiglu vLLM calls swigluoai.
    "gpt_oss-sinks-swigluoai": (
        "gpt_oss",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64},
    ),
    # minimax_m2: sigmoid routing with a (random) score-correction bias the block holds and
    # hands to its router; 3 layers, so two MoE layers register their runners by prefix.
    # rotary_dim, scoring_func and use_routing_bias are the Hub config's fields vLLM's own
    # file reads (transformers reads partial_rotary_factor from rotary_dim).
    "minimax_m2-block-correction-bias": (
        "minimax_m2",
        {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
            "num_hidden_layers": 3,
            "rotary_dim": 16,
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
        },
    ),
    # hy_v3: the same routing times router_scaling_factor, a shared expert added in float32,
    # a dense first layer and two MoE layers chosen by `A(...) if ... else B(...)`. The
    # last three fields are the Hub config's, read by vLLM's own hy_v3.py.
    "hy_v3-block-correction-bias-dense-first": (
        "hy_v3",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "num_hidden_layers": 3,
            "first_k_dense_replace": 1,
            "expert_hidden_dim": 64,
            "route_norm": True,
            "qk_norm": True,
        },
    ),
    # exaone_moe: DeepSeek-V3 routing in one group, experts counted by num_experts, a dense
    # first layer (mlp_layer_types) and exaone4's attention (rope on sliding layers only)
    "exaone_moe-dense-first-sliding": (
        "exaone_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "num_hidden_layers": 3,
            "first_k_dense_replace": 1,
            "sliding_window": 8,
        },
    ),
    # aria_text: a router whose softmax runs over the top-k logits, stacked experts transposed
    # ([E, H, 2I]) that the checkpoint names `experts.fc1.weight` / `fc2.weight` (transformers
    # renames them when it loads), and two shared experts in one wider MLP added to every token.
    # cohere2_moe: a parallel attention + MoE block off one LayerNorm, a router whose softmax
    # runs over the top-k logits on one branch of its switch (its renormalising division sits
    # on the sigmoid branch the file refuses), NoPE global layers with sliding windows, a
    # dense first layer (prefix_dense_intermediate_size)
    "cohere2_moe-softmax-over-top-k-parallel-block": (
        "cohere2_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "tie_word_embeddings": False,
        },
    ),
    # afmoe: attention gated by sigmoid(gate_proj(x)) per lane, rope on the sliding layers only,
    # sandwich norms, a dense first layer, sigmoid routing with a correction bias (choice only)
    # renormalised then scaled, and a shared expert viewed back to [batch, seq, hidden]
    "afmoe-sigmoid-output-gate-rope-on-sliding": (
        "afmoe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "num_hidden_layers": 3,
            "num_dense_layers": 1,
            "num_shared_experts": 1,
            "sliding_window": 8,
            "global_attn_every_n_layers": 2,
            "route_scale": 2.5,
            # the Hub config's routing fields, read by vLLM's own afmoe.py
            "score_func": "sigmoid",
            "route_norm": True,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    # ... with muP: the embeddings scaled by sqrt(hidden_size) under the source's own `if`, which
    # the file carries (traced with the switch off, as transformers' default config has it)
    "afmoe-mup-embeddings": (
        "afmoe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "num_dense_layers": 1,
            "num_shared_experts": 1,
            "mup_enabled": True,
            "tie_word_embeddings": False,
            "score_func": "sigmoid",
            "route_norm": True,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    # laguna: attention gated per head by softplus(g_proj(x)) computed in float32, a head count
    # per layer (the whole count sizes g_proj and o_proj; each rank keeps its share)
    "laguna-per-head-softplus-gate-heads-per-layer": (
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
    "aria_text-transposed-renamed-shared": (
        "aria_text",
        {"moe_num_experts": 8, "moe_topk": 2, "intermediate_size": 64, "moe_num_shared_experts": 2},
    ),
    # mellum: a softmax router renormalised over the top-k, experts stacked in the fused 3-D
    # layout in memory, a dense layer chosen by mlp_layer_types. vLLM serves it through its
    # Transformers backend (TransformersMoEForCausalLM): that is the native run here.
    "mellum-dense-first": (
        "mellum",
        {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "num_hidden_layers": 3,
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "norm_topk_prob": True,
        },
    ),
}
# vLLM 0.32's own olmoe.py ignores `clip_qkv` (it never clamps): there Hugging Face is the
# reference, and the generated file must match it, not vLLM native.
# vLLM 0.32's CPU router ignores ernie's score-correction bias (softmax routing takes its
# plain top-k path; native matches Hugging Face only when the bias is zero, checked by hand).
NATIVE_IGNORES_CONFIG = {
    "olmoe-clip-qkv",
    "ernie4_5_moe-correction-bias-shared",
    "ernie4_5_moe-correction-bias",
}
CARRIED_LINEARS = {
    "granitemoeshared": 2,
    "phimoe-carried-router": 1,
}  # source nn.Linear kept: shared MLP, router
CARRIED_ROUTERS = {"phimoe-carried-router"}
# vLLM 0.32's own cohere2_moe.py does not match transformers 5.19 on this checkpoint (tokens
# apart from the first step): Hugging Face is the reference there.
NATIVE_WRONG = {"cohere2_moe-softmax-over-top-k-parallel-block"}
# vLLM 0.32's own phimoe.py is not stable on CPU on this checkpoint: it agrees with Hugging
# Face on some machines (CI, serially), greedily emits token 0 at every step on others, and
# other tokens again while another vLLM runs beside it (make test's second worker). The
# generated file is held to Hugging Face as everywhere; vLLM's own is not the reference here.
NATIVE_UNSTABLE_ON_CPU = {"phimoe-carried-router"}
# vLLM 0.32 has no dots1 model file, and registers Aria's multimodal class only: Hugging Face
# is the reference
NO_NATIVE = {"dots1-grouped-sigmoid", "aria_text-transposed-renamed-shared"}
# vLLM 0.32's own dbrx.py cannot load a dbrx checkpoint (KeyError 'blocks.0.ffn.experts.w13_weight':
# its load_weights looks the experts up under names the fused-MoE runner no longer gives them).
# vLLM 0.32's own minimax_m2.py asks the CPU router for sigmoid scores without grouped top-k,
# which that router asserts against (AssertionError in cpu_router.py); the generated file
# takes the grouped path with one group, where the CPU router computes sigmoid routing.
# vLLM 0.32's own laguna.py does the same (sigmoid routing without grouped top-k).
NATIVE_FAILS = {
    "dbrx-clip-qkv",
    "minimax_m2-block-correction-bias",
    "laguna-per-head-softplus-gate-heads-per-layer",
}


def restack_experts(ckpt: Path) -> None:
    """Rewrite a per-expert checkpoint into the fused layout transformers 5.x holds in memory."""
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    out, grouped = {}, {}
    for key, tensor in tensors.items():
        if ".experts." in key:
            prefix, rest = key.split(".experts.", 1)
            index, name = rest.split(".", 1)
            grouped.setdefault(prefix, {}).setdefault(name, {})[int(index)] = tensor
        else:
            out[key] = tensor
    for prefix, names in grouped.items():

        def stack(n, names=names):
            return torch.stack([names[n][i] for i in sorted(names[n])])

        out[f"{prefix}.experts.gate_up_proj"] = torch.cat(
            [stack("gate_proj.weight"), stack("up_proj.weight")], dim=1
        )
        out[f"{prefix}.experts.down_proj"] = stack("down_proj.weight")
    save_file(out, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cases = []
    for name, (model_type, overrides) in CASES.items():
        ckpt = make_tiny_checkpoint(model_type, tmp_path_factory.mktemp(name), seed=len(cases), **overrides)
        if name.endswith("fused-3d-checkpoint"):
            restack_experts(ckpt)
        cases.append(VerifyCase(ckpt, GOLDEN / f"{model_type}.py"))
    return dict(zip(CASES, verify_many(cases)))


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_moe_golden_matches_hf_and_vllm_native(reports, case):
    report = reports[case]
    assert (report.native_tokens is None) == (case in NO_NATIVE | NATIVE_FAILS), report.summary()
    assert report.generated_tokens == report.hf_tokens, report.summary()
    assert report.logprob_diff_hf is not None and report.logprob_diff_hf <= LOGPROB_TOL, report.summary()
    problems = list(report.problems)
    if case in NATIVE_FAILS:
        assert any("native run failed" in p for p in problems), "vLLM native now runs: drop the exemption"
        problems = [p for p in problems if "native run failed" not in p]
    elif case in NATIVE_IGNORES_CONFIG | NATIVE_WRONG:
        assert report.native_tokens != report.hf_tokens, "vLLM native now agrees with HF: drop the exemption"
        problems = [p for p in problems if "native" not in p]  # only the native comparison is exempt
    elif case in NATIVE_UNSTABLE_ON_CPU and report.native_tokens != report.hf_tokens:
        problems = [p for p in problems if "native" not in p]
    elif case not in NO_NATIVE:
        assert report.generated_tokens == report.native_tokens, report.summary()
        assert report.logprob_diff_native is not None and report.logprob_diff_native <= LOGPROB_TOL, (
            report.summary()
        )
    assert report.generated_class.startswith("hfrewrite_generated_"), report.summary()
    assert problems == [], report.summary()


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_moe_layers_use_fused_experts(reports, case):
    _model_type, overrides = CASES[case]
    first_sparse = next(
        (
            overrides[k]
            for k in ("first_k_dense_replace", "moe_layer_start_index", "num_dense_layers")
            if k in overrides
        ),
        0,
    )
    dense = set(overrides.get("mlp_only_layers", [])) | set(range(first_sparse))
    dense |= {i for i, kind in enumerate(overrides.get("mlp_layer_types", [])) if kind == "dense"}
    structure = reports[case].generated_structure
    assert structure, reports[case].summary()
    for i, layer in enumerate(structure):
        assert layer["Linear"] == CARRIED_LINEARS.get(case, 0) and layer["QKVParallelLinear"] == 1, layer
        if i in dense:
            assert layer["MoERunner"] == 0 and layer["MergedColumnParallelLinear"] == 1, layer
        else:
            assert layer["MoERunner"] == 1 and layer["GateLinear"] == int(case not in CARRIED_ROUTERS), layer
    # vLLM sees the MixtureOfExperts interface, counting exactly the sparse layers.
    assert reports[case].generated_facts["num_moe_layers"] == len(structure) - len(dense)
    assert reports[case].generated_facts["supports_pp"] is True


@pytest.mark.parametrize("model_type", sorted({t for t, _ in CASES.values()}))
def test_emitted_moe_forward_has_no_loop_over_experts(model_type):
    tree = ast.parse((GOLDEN / f"{model_type}.py").read_text())
    blocks = [
        n
        for n in tree.body
        if isinstance(n, ast.ClassDef)
        and "FusedMoEFactory(" in ast.unparse(n)
        and not any(isinstance(b, ast.Name) and b.id == "MixtureOfExperts" for b in n.bases)
    ]
    assert len(blocks) == 1
    assert not [n for n in ast.walk(blocks[0]) if isinstance(n, (ast.For, ast.While, ast.comprehension))]
    assert "FusedMoEFactory(" in ast.unparse(blocks[0])
