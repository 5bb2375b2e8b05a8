"""Latent attention on vLLM's per-head ``Attention`` (analyze/mla_cache.py: ``PER_HEAD``).

Where vLLM 0.32 gives a model type no latent cache, the file expands the latent into per-head
k and v, as vLLM's own ``minicpm3.py`` does: ``kv_b`` gives k_nope and v, the rope key is
shared by every head, v is padded with zeros to the q/k head size (vLLM's ``Attention`` has
one head size; zero columns of v give zero columns of the output, which are cut off).
``d`` maps an MLA size to the attention module's attribute holding it.
"""

from __future__ import annotations


def per_head_attention(d, scaling: str, name: str) -> str:
    """``__init__``'s tail: the guard on the head sizes, and vLLM's ``Attention``."""
    v, qk = f"self.{d('v_head_dim')}", f"self.{d('qk_head_dim')}"
    return (
        f"if {v} > {qk}:\n"
        f'    raise NotImplementedError("hfrewrite: {name}: v heads wider than the q/k heads '
        '(the file pads v to the q/k head size)")\n'
        "self.attn = Attention(\n"
        "    self.num_local_heads,\n"
        f"    {qk},\n"
        f"    {scaling},\n"
        "    num_kv_heads=self.num_local_heads,\n"
        "    cache_config=cache_config,\n"
        "    quant_config=quant_config,\n"
        '    prefix=f"{prefix}.attn",\n'
        ")\n"
    )


def per_head_call(d, kv_b: str, o: str) -> str:
    """``forward``'s tail, from the roped ``q`` [tokens, heads, qk] and ``k_pe`` [tokens, 1, rope]."""
    nope, v_head, qk = (f"self.{d(s)}" for s in ("qk_nope_head_dim", "v_head_dim", "qk_head_dim"))
    return (
        f"kv = self.{kv_b}(kv_c_normed)[0].view(-1, self.num_local_heads, {nope} + {v_head})\n"
        f"k_nope, v = kv.split([{nope}, {v_head}], dim=-1)\n"
        "k = torch.cat([k_nope, k_pe.expand(-1, self.num_local_heads, -1)], dim=-1)\n"
        "# One head size in vLLM's Attention: v padded with zeros, the output cut back.\n"
        f"v = torch.nn.functional.pad(v, [0, {qk} - {v_head}])\n"
        "attn_output = self.attn(q.reshape(q.shape[0], -1), k.reshape(q.shape[0], -1), v.reshape(q.shape[0], -1))\n"
        f"attn_output = attn_output.view(-1, self.num_local_heads, {qk})[..., : {v_head}]\n"
        f"return self.{o}(attn_output.reshape(-1, self.num_local_heads * {v_head}))[0]\n"
    )
