"""Chunked attention (Llama-4's ``chunked_attention`` layers): each token attends to the
keys of its own chunk of ``config.attention_chunk_size`` positions, causally.

The example run sees it on the masks the layers are given (analyze/attention_options.py:
the shrunk config's chunks are shorter than the example). The file builds vLLM's
``ChunkedLocalAttention`` where transformers' mask mapping makes a chunked mask: on the
layers whose ``config.layer_types`` entry is ``"chunked_attention"``, of the chunk size
``config.attention_chunk_size`` holds. Both are checked against the masks the traced layers
were given; any other layout of chunks is refused.
"""

from __future__ import annotations

from hfrewrite.analyze.layer_agreement import LayerFacts
from hfrewrite.analyze.plan import AttentionPlan, refuse

CHUNKED = "chunked_attention"  # the layer type transformers' mask mapping chunks


def chunked_layers(per_layer: list[LayerFacts], small, attention: AttentionPlan) -> int | None:
    """The chunk size the traced layers attend within, where they do, else None; refuses a
    chunking the config's ``attention_chunk_size`` and ``layer_types`` do not describe."""
    chunks = {i: f.attention.attention_chunk for i, f in enumerate(per_layer) if f.attention is not None}
    found = set(chunks.values()) - {None}
    if not found:
        return None
    name = attention.module_class
    size = getattr(small, "attention_chunk_size", None)
    if found != {size}:
        refuse(
            "vllm_attention",
            f"chunked attention of {sorted(found)} tokens, not config.attention_chunk_size",
            name,
        )
    types = getattr(small, "layer_types", None)
    if not isinstance(types, list) or len(types) != len(per_layer):
        refuse("vllm_attention", "chunked attention on layers no config.layer_types names", name)
    if any((types[i] == CHUNKED) != (chunk is not None) for i, chunk in chunks.items()):
        refuse(
            "vllm_attention", f"the chunked layers are not those config.layer_types names {CHUNKED!r}", name
        )
    return size
