"""The pass registry: every file in passes/ is registered once, in one order, under a unique
name; the runner records how many sites each pass rewrote."""

from pathlib import Path

import libcst as cst
import pytest

from hfrewrite.analyze.model import analyze
from hfrewrite.emit.pass_api import PassContext
from hfrewrite.emit.passes_doc import render
from hfrewrite.emit.pipeline import PASSES, describe, run_passes
from hfrewrite.resolve import resolve

PASSES_DIR = Path(__file__).resolve().parents[1] / "passes"


def test_every_pass_file_is_registered_once():
    files = sorted(p.stem for p in PASSES_DIR.glob("*.py") if p.stem != "__init__")
    registered = [Path(p.__file__).stem for p in PASSES]
    assert sorted(registered) == files
    assert len(set(registered)) == len(registered)


def test_pass_names_are_unique_and_match_their_files():
    names = [p.NAME for p in PASSES]
    assert len(set(names)) == len(names)
    assert names == [Path(p.__file__).stem for p in PASSES]


def test_every_pass_documents_pattern_and_output():
    for p in PASSES:
        doc = p.__doc__ or ""
        assert describe(p), p.NAME
        assert "Matches" in doc and ("Emits" in doc or "Emit" in doc) and "Preconditions" in doc, p.NAME


def test_docs_passes_page_is_generated_from_the_docstrings():
    doc = (PASSES_DIR.parent / "docs" / "passes.md").read_text()
    assert doc == render(), "docs/passes.md is stale: run `make docs`"
    headings = [line.split("`")[1] for line in doc.splitlines() if line.startswith("## ")]
    assert headings == [p.NAME for p in PASSES]


# The sites each pass rewrote, read off golden/<type>.py: the classes it rewrote, or the
# constructions it emitted (row_parallel, fused_residual_norm), or (prune_unused_params,
# type_config_params) the __init__ parameters that differ from the modeling source.
# strip_hf_runtime counts the names the modeling source imports from Transformers internals.
MATCHES = {
    "llama": {
        "flatten_base_model": 0,  # no parts deeper than the base model
        "taken_branches": 0,
        "block_kinds": 0,
        "inline_helpers": 0,  # no helper method holds the projections
        "carry_decoder_layer": 0,  # LlamaDecoderLayer.forward takes `residual`: fused, not carried
        "fuse_qkv": 1,  # LlamaAttention.qkv_proj
        "vllm_attention": 1,  # LlamaAttention
        "mla_attention": 0,
        "fuse_gate_up": 1,  # LlamaMLP.gate_up_proj
        "fuse_experts": 0,
        "row_parallel": 2,  # o_proj, down_proj
        "parallel_sequential": 0,  # no nn.Sequential MLP
        "fused_residual_norm": 3,  # RMSNorm: input_layernorm, post_attention_layernorm, norm
        "parallel_embedding": 2,  # embed_tokens, lm_head
        "vllm_model_interface": 2,  # LlamaModel, LlamaForCausalLM
        "moe_interface": 0,
        "hybrid_mixer": 0,
        "thread_layer_args": 3,  # prefix: LlamaMLP, LlamaAttention, LlamaDecoderLayer
        "load_weights": 1,  # LlamaForCausalLM.hf_to_vllm_mapper
        "config_guards": 0,
        "strip_hf_runtime": 25,
        "prune_unused_params": 2,  # layer_idx of LlamaAttention and LlamaDecoderLayer
        "drop_dead_locals": 0,  # no unread computed local
        "stale_docstrings": 0,  # no Args: section naming a parameter gone
        "type_config_params": 1,  # LlamaMLP(config: LlamaConfig)
        "composite_text": 0,  # a text model's config
    },
    "qwen3_moe": {
        "flatten_base_model": 0,  # no parts deeper than the base model
        "taken_branches": 0,
        "block_kinds": 0,
        "inline_helpers": 0,  # no helper method holds the projections
        "carry_decoder_layer": 0,
        "fuse_qkv": 1,  # Qwen3MoeAttention
        "vllm_attention": 1,  # Qwen3MoeAttention
        "mla_attention": 0,
        "fuse_gate_up": 1,  # Qwen3MoeMLP (the dense layers')
        "fuse_experts": 1,  # Qwen3MoeSparseMoeBlock
        "row_parallel": 2,  # o_proj, Qwen3MoeMLP.down_proj
        "parallel_sequential": 0,  # no nn.Sequential MLP
        "fused_residual_norm": 5,  # RMSNorm: q_norm, k_norm, the layer's two, norm
        "parallel_embedding": 2,
        "vllm_model_interface": 2,
        "moe_interface": 1,  # Qwen3MoeForCausalLM(..., MixtureOfExperts)
        "hybrid_mixer": 0,
        "thread_layer_args": 4,  # attention, MLP, sparse MoE block, decoder layer
        "load_weights": 1,
        "config_guards": 0,
        "strip_hf_runtime": 29,
        "prune_unused_params": 1,  # Qwen3MoeAttention's layer_idx
        "drop_dead_locals": 0,  # no unread computed local
        "stale_docstrings": 0,  # no Args: section naming a parameter gone
        "type_config_params": 1,  # Qwen3MoeMLP
        "composite_text": 0,  # a text model's config
    },
    "deepseek_v3": {
        "flatten_base_model": 0,  # no parts deeper than the base model
        "taken_branches": 0,
        "block_kinds": 0,
        "inline_helpers": 0,  # no helper method holds the projections
        "carry_decoder_layer": 0,
        "fuse_qkv": 0,  # latent attention: mla_attention's
        "vllm_attention": 0,
        "mla_attention": 1,  # DeepseekV3Attention
        "fuse_gate_up": 1,  # DeepseekV3MLP
        "fuse_experts": 1,  # DeepseekV3MoE
        "row_parallel": 1,  # DeepseekV3MLP.down_proj (o_proj is mla_attention's)
        "parallel_sequential": 0,  # no nn.Sequential MLP
        "fused_residual_norm": 5,  # RMSNorm: q_a_layernorm, kv_a_layernorm, the layer's two, norm
        "parallel_embedding": 2,
        "vllm_model_interface": 2,
        "moe_interface": 1,
        "hybrid_mixer": 0,
        "thread_layer_args": 4,  # MLP, MoE block, attention, decoder layer
        "load_weights": 1,
        "config_guards": 0,
        "strip_hf_runtime": 26,
        "prune_unused_params": 1,  # DeepseekV3Attention's layer_idx
        "drop_dead_locals": 0,  # no unread computed local
        "stale_docstrings": 0,  # no Args: section naming a parameter gone
        "type_config_params": 1,  # DeepseekV3MLP
        "composite_text": 0,  # a text model's config
    },
    "gemma": {
        "flatten_base_model": 0,  # no parts deeper than the base model
        "taken_branches": 0,
        "block_kinds": 0,
        "inline_helpers": 0,  # no helper method holds the projections
        "carry_decoder_layer": 0,
        "fuse_qkv": 1,
        "vllm_attention": 1,
        "mla_attention": 0,
        "fuse_gate_up": 1,
        "fuse_experts": 0,
        "row_parallel": 2,
        "parallel_sequential": 0,  # no nn.Sequential MLP
        "fused_residual_norm": 3,  # GemmaRMSNorm: the layer's two, norm
        "parallel_embedding": 3,  # GemmaTextScaledWordEmbedding rebased, embed_tokens, lm_head
        "vllm_model_interface": 2,
        "moe_interface": 0,
        "hybrid_mixer": 0,
        "thread_layer_args": 3,
        "load_weights": 1,
        "config_guards": 1,  # GemmaAttention: is_causal from use_bidirectional_attention
        "strip_hf_runtime": 24,
        "prune_unused_params": 3,  # padding_idx of the embedding, layer_idx of attention and layer
        "drop_dead_locals": 0,  # no unread computed local
        "stale_docstrings": 0,  # no Args: section naming a parameter gone
        "type_config_params": 1,  # GemmaMLP
        "composite_text": 0,  # a text model's config
    },
    "starcoder2": {
        "flatten_base_model": 0,  # no parts deeper than the base model
        "taken_branches": 0,
        "block_kinds": 0,
        "inline_helpers": 0,  # no helper method holds the projections
        "carry_decoder_layer": 1,  # Starcoder2DecoderLayer: LayerNorms kept, forward carried
        "fuse_qkv": 1,
        "vllm_attention": 1,
        "mla_attention": 0,
        "fuse_gate_up": 0,  # an ungated MLP
        "fuse_experts": 0,
        "row_parallel": 3,  # o_proj, c_proj (row), c_fc (column)
        "parallel_sequential": 0,  # no nn.Sequential MLP
        "fused_residual_norm": 0,  # the source's norms are kept
        "parallel_embedding": 2,
        "vllm_model_interface": 2,
        "moe_interface": 0,
        "hybrid_mixer": 0,
        "thread_layer_args": 3,
        "load_weights": 1,
        "config_guards": 0,
        "strip_hf_runtime": 25,
        "prune_unused_params": 2,  # layer_idx of attention and layer
        "drop_dead_locals": 0,  # no unread computed local
        "stale_docstrings": 0,  # no Args: section naming a parameter gone
        "type_config_params": 0,  # the source annotates its configs
        "composite_text": 0,  # a text model's config
    },
}


@pytest.mark.parametrize("model_type", list(MATCHES))
def test_passes_report_the_sites_they_rewrote(model_type):
    resolved = resolve(model_type)
    module = cst.parse_module(resolved.modeling_path.read_text(encoding="utf-8"))
    result = run_passes(module, PassContext(analyze(resolved.config), resolved.modeling_path.name))
    assert result.matches == MATCHES[model_type]
