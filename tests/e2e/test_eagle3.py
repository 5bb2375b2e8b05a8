"""EAGLE-3 speculative decoding on generated files (``SupportsEagle3``, the base model's
``EagleModelMixin``), in real vLLM on CPU.

The draft is made here, in vLLM's EAGLE-3 Llama layout (``LlamaForCausalLMEagle3``: one
decoder layer reading the embeddings beside ``fc`` of three target layers' hidden states,
``eagle_aux_hidden_state_layer_ids``). Its ``fc`` passes the last of those states through
(the last layer's output), its layer adds nothing (zero output projections), its norm and
head are the target's: what it proposes is a function of the hidden states the target hands
it. So:

- greedy tokens with speculation equal Hugging Face's (speculation never changes them);
- the generated Llama's draft proposes, and has accepted, exactly what vLLM's own
  ``llama.py`` has with the same draft, position by position: the same hidden states;
- a carried-layer model (Gemma-2: sandwich norms, soft caps) runs with a draft too, its
  tokens equal Hugging Face's;
- GPT-2's file, whose base model keeps the checkpoint's name (``transformer``), declares no
  EAGLE-3: vLLM's proposer looks for the target's embeddings at ``model`` and stops there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hfrewrite.verify.fixtures import DEFAULT_PROMPTS, make_tiny_checkpoint
from hfrewrite.verify.runner import run_worker

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
LAYERS = 8
AUX_LAYERS = [LAYERS - 2, LAYERS - 1, LAYERS]  # the last one: the last layer's output


def eagle3_draft(target: Path, out: Path, norm: str, head: str) -> Path:
    """An EAGLE-3 draft for ``target`` proposing from the last aux layer's hidden state."""
    config = json.loads((target / "config.json").read_text())
    tensors = load_file(target / "model.safetensors")
    hidden = tensors[head].shape[1]
    heads, head_dim = 4, 32
    draft = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "vocab_size": tensors[head].shape[0],
        "draft_vocab_size": tensors[head].shape[0],
        "max_position_embeddings": 512,
        "rms_norm_eps": config.get("rms_norm_eps", 1e-5),
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS},
    }
    if "bos_token_id" in config:
        draft["bos_token_id"] = config["bos_token_id"]
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    width = heads * head_dim
    weights = {
        "midlayer.self_attn.q_proj.weight": rand(width, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(width, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(width, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": torch.zeros(hidden, width),
        "midlayer.mlp.gate_proj.weight": rand(2 * hidden, hidden),
        "midlayer.mlp.up_proj.weight": rand(2 * hidden, hidden),
        "midlayer.mlp.down_proj.weight": torch.zeros(hidden, 2 * hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        # fc: [h_{L-2}; h_{L-1}; h_L] -> h_L
        "fc.weight": torch.cat([torch.zeros(hidden, 2 * hidden), torch.eye(hidden)], dim=1),
        "norm.weight": tensors[norm].clone(),
        "lm_head.weight": tensors[head].clone(),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(draft, indent=2))
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _runs(ckpt: Path, draft: Path, architecture: str, module: Path, native: bool) -> list[dict]:
    common = {
        "ckpt": str(ckpt),
        "prompts": [list(p) for p in DEFAULT_PROMPTS],
        "max_tokens": 16,
        "architecture": architecture,
    }
    spec = {
        "speculative_config": {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2},
        "disable_log_stats": False,
    }
    runs = [
        {"kind": "hf", **common, "generated_module": None},
        {"kind": "vllm", **common, "generated_module": str(module), "llm_kwargs": spec},
    ]
    if native:
        runs.append({"kind": "vllm", **common, "generated_module": None, "llm_kwargs": spec})
    return runs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    llama = make_tiny_checkpoint("llama", root / "llama", seed=0, num_hidden_layers=LAYERS)
    gemma2 = make_tiny_checkpoint(
        "gemma2", root / "gemma2", seed=1, num_hidden_layers=LAYERS, tie_word_embeddings=False
    )
    gpt2 = make_tiny_checkpoint("gpt2", root / "gpt2", seed=2, n_layer=LAYERS)
    runs = _runs(
        llama,
        eagle3_draft(llama, root / "llama-draft", "model.norm.weight", "lm_head.weight"),
        "LlamaForCausalLM",
        GOLDEN / "llama.py",
        native=True,
    )
    runs += _runs(
        gemma2,
        eagle3_draft(gemma2, root / "gemma2-draft", "model.norm.weight", "lm_head.weight"),
        "Gemma2ForCausalLM",
        GOLDEN / "gemma2.py",
        native=False,
    )
    runs += _runs(
        gpt2,
        eagle3_draft(gpt2, root / "gpt2-draft", "transformer.ln_f.weight", "transformer.wte.weight"),
        "GPT2LMHeadModel",
        GOLDEN / "gpt2.py",
        native=False,
    )[1:]
    found, info = run_worker(runs, timeout=900)
    return found, info


@pytest.mark.vllm
def test_generated_llama_speculates_as_vllms_own_with_the_same_hidden_states(results):
    (hf, generated, native, *_), info = results
    assert "error" not in generated, generated.get("error", "") + info["stderr_tail"]
    assert "error" not in native, native.get("error", "") + info["stderr_tail"]
    assert generated["tokens"] == hf["tokens"]
    assert native["tokens"] == hf["tokens"]
    ours, theirs = generated["spec_decode"], native["spec_decode"]
    assert ours["num_draft_tokens"] > 0 and ours["num_accepted_tokens"] > 0, ours
    assert ours == theirs  # drafts, draft tokens, accepted tokens, accepted per position


@pytest.mark.vllm
def test_a_carried_model_speculates_with_a_draft(results):
    (*_, hf, generated, _gpt2), info = results
    assert "error" not in generated, generated.get("error", "") + info["stderr_tail"]
    assert generated["tokens"] == hf["tokens"]
    assert generated["spec_decode"]["num_draft_tokens"] > 0


@pytest.mark.vllm
def test_a_file_whose_base_model_vllms_proposer_cannot_find_declares_no_eagle3(results):
    (*_, gpt2), _info = results
    assert "Target model does not have 'model' attribute" in gpt2.get("error", ""), gpt2
    text = (GOLDEN / "gpt2.py").read_text()
    assert "SupportsEagle3" not in text and "EagleModelMixin" not in text  # nor the collection
