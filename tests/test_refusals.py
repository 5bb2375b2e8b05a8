"""Architectures whose patterns do not match are refused with the reason, through the real
pipeline and the console script: one stderr line, exit code 2, nothing written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HFREWRITE = Path(sys.executable).parent / "hfrewrite"


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        # Kimi's delta attention (short convolutions per q, k and v, a per-channel decay): a
        # kind vLLM has a layer for, on triton kernels only, recognised by its parts.
        (
            "kimi_linear",
            "KimiLinearDeltaAttention: vllm_attention: a Kimi delta attention block",
        ),
        # transformers' own default LFM2-MoE config has no layer_types and builds no model:
        # the user is told to convert a real config instead.
        (
            "lfm2_moe",
            "(transformers 5.19.0's default lfm2_moe config builds no model: convert a checkpoint's",
        ),
        # Zamba's default config builds, its shrunk copy (two layers, against the weight tying
        # of its shared block) does not: the line says whose limit that is.
        (
            "zamba",
            "(the config itself builds: the shrunk copy the analysis traces does not, a limit of hfrewrite)",
        ),
        # AXK2's input norm is gated by an MLP of its own: two children beside the attention
        # hold linears, each named with its class.
        (
            "axk2",
            (
                "2 children beside the attention in self_attn (AXK2Attention) hold linears "
                "(input_layernorm (AXK2GatedRMSNorm), mlp (AXK2MLP))"
            ),
        ),
        # LongCat-Flash runs two attentions in every layer.
        ("longcat_flash", "2 children attend (self_attn.0 (LongcatFlashMLA), self_attn.1 (LongcatFlashMLA))"),
        # DeepSeek-V4 mixes its residual streams (hyper-connections) before the final norm.
        ("deepseek_v4", "(the last layer's output is read by hc_head (DeepseekV4HyperHead))"),
        # Inkling convolves k over time before its attention.
        ("inkling_text", "the k path computes add in k_sconv (InklingShortConvolution)"),
        # ModernBERT-decoder's token embedding sits in a module with a norm after it.
        (
            "modernbert-decoder",
            "it sits deeper (embeddings.tok_embeddings, inside ModernBertDecoderEmbeddings)",
        ),
        # DeepSeek-V3.2's sparse-attention indexer: linears beside the latent attention's,
        # named with the module that holds them.
        (
            "deepseek_v32",
            "other linears in the block: ['indexer.weights_proj', 'indexer.wk', 'indexer.wq_b'], in indexer (DeepseekV32Indexer)",
        ),
        # MiniMax-M3's attention runs its indexer under a test: the statement's header line.
        (
            "minimax_m3_vl_text",
            "forward does something vLLM's attention would not: if self.indexer is not None:",
        ),
        # PLBart's decoder used alone: its config is the encoder-decoder family's.
        ("plbart", "PLBartDecoderWrapper: model_layout: an encoder-decoder model (is_encoder_decoder)"),
        # BERT's causal LM: its layers sit in encoder.layer, not in a list under the base model.
        (
            "bert",
            "BertModel: model_layout: no list of layers is a child of the base model; its lists sit deeper (encoder.layer)",
        ),
        # HRM runs two stacks of layers in cycles.
        ("hrm_text", "its lists sit deeper (L_module.layers, H_module.layers)"),
        # RecurrentGemma's RG-LRU: no softmax attention, no mixer hfrewrite knows.
        ("recurrent_gemma", "RecurrentGemmaRecurrentBlock: vllm_attention: no softmax attention call"),
        # Phi-4-multimodal builds its vision and audio encoders under the embedding.
        (
            "phi4_multimodal",
            "beside its decoder stack: embed_tokens_extend.image_embed.img_processor (Phi4MultimodalVisionModel)",
        ),
    ],
)
def test_unmatched_architecture_is_refused(tmp_path, model_type, reason):
    out = tmp_path / "out"
    proc = subprocess.run(
        [str(HFREWRITE), "convert", "--no-verify", model_type, "-o", str(out)],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("W11")]  # torch's triton notice
    assert len(lines) == 1 and lines[0].startswith("hfrewrite: error: "), proc.stderr
    assert reason in lines[0]
    assert not out.exists() or list(out.iterdir()) == []
