"""Hypothesis strategies for the classic families' configs (GPT-2 to CTRL), each in its own
field names, with the switches that change their code: fused or split projections, ALiBi,
parallel blocks, post-norms, local windows, partial rope, scaled embeddings. Heads of 32 or
64 lanes (the CPU attention backend needs head_dim >= 32)."""

from __future__ import annotations

from hypothesis import strategies as st

CLASSIC = (
    "gpt2",
    "gpt_bigcode",
    "bloom",
    "falcon",
    "opt",
    "gptj",
    "codegen",
    "gpt_neo",
    "stablelm",
    "mpt",
    "xglm",
    "biogpt",
    "ctrl",
    "phi",
    "starcoder2",
)


def _kv(draw, heads: int) -> int:
    return draw(st.sampled_from([d for d in (1, 2, 4) if heads % d == 0]))


def classic_fields(draw, family: str) -> dict:
    """A drawn config of ``family`` (without the ids, which the caller adds)."""
    n = draw(st.sampled_from([2, 4]))
    hidden = n * draw(st.sampled_from([32, 64]))
    layers = draw(st.integers(1, 3))
    inner = draw(st.sampled_from([64, 128, 256]))
    tie = {"tie_word_embeddings": draw(st.booleans())}
    gpt = {"n_embd": hidden, "n_head": n, "n_layer": layers, "n_inner": inner}
    if family == "gpt2":
        return (
            tie
            | gpt
            | {
                "activation_function": draw(st.sampled_from(["gelu_new", "relu", "gelu_pytorch_tanh"])),
                "scale_attn_weights": draw(st.booleans()),
                "scale_attn_by_inverse_layer_idx": draw(st.booleans()),
            }
        )
    if family == "gpt_bigcode":
        return tie | gpt | {"multi_query": draw(st.booleans()), "scale_attn_weights": draw(st.booleans())}
    if family in ("gptj", "codegen"):
        heads = {"n_head": 4} if family == "codegen" else {}  # CodeGen's four qkv blocks
        return tie | gpt | heads | {"rotary_dim": draw(st.sampled_from([16, 32]))}
    if family == "ctrl":
        return tie | {"n_embd": hidden, "n_head": n, "n_layer": layers, "dff": inner}
    if family == "bloom":
        post = draw(st.booleans())
        return tie | {
            "hidden_size": hidden,
            "n_head": n,
            "n_layer": layers,
            "apply_residual_connection_post_layernorm": post,
        }
    if family == "falcon":
        return tie | _falcon(draw, n, hidden, layers, inner)
    if family == "opt":
        return tie | {
            "hidden_size": hidden,
            "word_embed_proj_dim": hidden,
            "num_attention_heads": n,
            "num_hidden_layers": layers,
            "ffn_dim": inner,
            "enable_bias": draw(st.booleans()),
            "activation_function": draw(st.sampled_from(["relu", "gelu"])),
        }
    if family == "gpt_neo":
        kinds = draw(st.lists(st.sampled_from(["global", "local"]), min_size=layers, max_size=layers))
        return tie | {
            "hidden_size": hidden,
            "num_heads": n,
            "num_layers": layers,
            "intermediate_size": inner,
            "attention_types": [[kinds, 1]],
            "window_size": draw(st.sampled_from([4, 8, 256])),
        }
    if family == "mpt":
        return tie | {
            "d_model": hidden,
            "n_heads": n,
            "n_layers": layers,
            "expansion_ratio": draw(st.sampled_from([2, 4])),
            "no_bias": draw(st.booleans()),
            "max_seq_len": 256,
        }
    if family in ("xglm", "biogpt"):
        names = ("d_model", "attention_heads", "num_layers", "ffn_dim")
        if family == "biogpt":
            names = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")
        return tie | dict(zip(names, (hidden, n, layers, inner))) | {"scale_embedding": draw(st.booleans())}
    llama_names = {
        "hidden_size": hidden,
        "num_attention_heads": n,
        "num_key_value_heads": _kv(draw, n),
        "num_hidden_layers": layers,
        "intermediate_size": inner,
    }
    if family == "stablelm":
        return (
            tie
            | llama_names
            | {
                "partial_rotary_factor": draw(st.sampled_from([0.25, 0.5, 1.0])),
                "use_qkv_bias": draw(st.booleans()),
                "use_parallel_residual": draw(st.booleans()),
                "qk_layernorm": draw(st.booleans()),  # StableLM-2-12B: a LayerNorm per head
            }
        )
    if family == "phi":
        return tie | llama_names | {"partial_rotary_factor": draw(st.sampled_from([0.5, 1.0]))}
    assert family == "starcoder2", family
    return (
        tie
        | llama_names
        | {
            "use_bias": draw(st.booleans()),
            "sliding_window": draw(st.sampled_from([None, 4, 8])),
        }
    )


def _falcon(draw, n: int, hidden: int, layers: int, inner: int) -> dict:
    """Falcon's layouts: one kv head (7B), grouped kv heads (40B's new architecture) or
    multi-head; a parallel or sequential block; ALiBi or rope."""
    new = draw(st.booleans())
    fields = {
        "hidden_size": hidden,
        "num_attention_heads": n,
        "num_hidden_layers": layers,
        "ffn_hidden_size": inner,
        "new_decoder_architecture": new,
        "multi_query": draw(st.booleans()),
        "parallel_attn": draw(st.booleans()),
        "bias": draw(st.booleans()),
        "alibi": draw(st.booleans()),
    }
    if new:
        fields["num_kv_heads"] = _kv(draw, n)
    return fields
