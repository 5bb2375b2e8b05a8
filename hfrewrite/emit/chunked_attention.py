"""vLLM's ``ChunkedLocalAttention`` for the layers the analysis found chunked
(analyze/chunked_layers.py), chosen in the attention ``__init__`` as transformers' mask
mapping chooses their masks: by ``config.layer_types[layer_idx]``."""

from __future__ import annotations

import libcst as cst

from hfrewrite.analyze.chunked_layers import CHUNKED
from hfrewrite.analyze.plan import AttentionPlan
from hfrewrite.errors import HfrewriteError

_PASS = "vllm_attention"

_CHUNKED = """\
# Chunked layers attend within chunks of config.attention_chunk_size positions (the
# layers transformers' mask mapping gives a chunked mask, checked on the traced ones).
chunked = (
    {{"attention_chunk_size": config.attention_chunk_size}}
    if config.layer_types[layer_idx] == "{chunked}"
    else {{}}
)
attention_class = ChunkedLocalAttention if chunked else Attention
"""


def chunked_attention(att: AttentionPlan, init: cst.FunctionDef, name: str) -> str:
    """The statements choosing vLLM's chunked attention for the chunked layers."""
    if not att.attention_chunk:
        return ""
    if not {"config", "layer_idx"} <= {p.name.value for p in init.params.params}:
        raise HfrewriteError(f"{name}: {_PASS}: chunked attention, but __init__ has no config and layer_idx")
    return _CHUNKED.format(chunked=CHUNKED)
