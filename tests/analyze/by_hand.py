"""tinyllama_renamed's attention helper written out by hand (matmul, mask, softmax, matmul),
as older Hub custom code computes attention; shared by the analysis and e2e tests."""

HELPER = """    if t == s:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # Decoding with a cache: query i sits at position s - t + i and sees keys 0 .. s - t + i.
    mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
"""
# the same helper written out by hand, as older custom code does
BY_HAND = """    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    future = torch.ones(t, s, dtype=torch.bool, device=q.device).triu(diagonal=s - t + 1)
    scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)
"""


def attention_by_hand(source: str) -> str:
    """modeling_tinyllama_renamed.py's text with its SDPA helper written out by hand."""
    assert source.count(HELPER) == 1
    return source.replace("import torch\n", "import math\n\nimport torch\n", 1).replace(HELPER, BY_HAND)


# the same with batch and heads flattened into one dim for the two matmuls (Falcon-RW, BLOOM)
BY_HAND_FLAT = """    b, h = q.shape[:2]
    scores = torch.matmul(q.reshape(b * h, t, -1), k.reshape(b * h, s, -1).transpose(-2, -1))
    scores = scores.view(b, h, t, s) / math.sqrt(q.shape[-1])
    future = torch.ones(t, s, dtype=torch.bool, device=q.device).triu(diagonal=s - t + 1)
    scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs.view(b * h, t, s), v.reshape(b * h, s, -1)).view(b, h, t, -1)
"""
