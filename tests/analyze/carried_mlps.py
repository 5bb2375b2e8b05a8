"""tinyllama_renamed's gated MLP rewritten into forms vLLM has no *AndMul for; shared by the
analysis and e2e tests of the MLP sharded with its own code (mlp_pairwise.py) or kept from
the source (carried_mlp.py)."""

CLASS = """class FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w_gate = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w_up = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w_down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
"""
_SEPARATE = CLASS.split("\n    def forward")[0].rstrip()
_FUSED = """class FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.alpha, self.limit = 1.702, 7.0
        self.w_gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w_down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)"""

VARIANTS = {
    # MiniMax-M3's dense MLP: one [gate; up] Linear, a clamped SwiGLU on its halves
    "clamped_swiglu": _FUSED
    + """

    def forward(self, x):
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return self.w_down((up + 1.0) * gate * torch.sigmoid(gate * self.alpha))
""",
    # NormFormer's FFN: a LayerNorm over the whole intermediate (no column shard computes it)
    "inner_norm": _SEPARATE
    + """
        self.inner_norm = nn.LayerNorm(config.intermediate_size)

    def forward(self, x):
        return self.w_down(self.inner_norm(F.silu(self.w_gate(x)) * self.w_up(x)))
""",
    # each token's up reads the token before it: vLLM's flat batch would mix sequences
    "token_shift": _SEPARATE
    + """

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x.roll(1, dims=-2)).mean(-1, keepdim=True))
""",
    # needs [batch, seq, hidden]: vLLM hands the layer [tokens, hidden]
    "batch_layout": _SEPARATE
    + """

    def forward(self, x):
        b, t, h = x.shape
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x).mean(-1, keepdim=True)).view(b, t, h)
""",
    # torch's own container from a builder function (CTRL's point_wise_feed_forward_network):
    # Linear, an elementwise act, Linear; built as vLLM's column- and row-parallel pair
    "sequential": """def FeedForward(config):
    return nn.Sequential(
        nn.Linear(config.hidden_size, config.intermediate_size),
        nn.GELU(),
        nn.Linear(config.intermediate_size, config.hidden_size),
    )
""",
    # the same with a LayerNorm over the whole intermediate: no column shard computes it, the
    # container stays as the source builds it
    "sequential_inner_norm": """def FeedForward(config):
    return nn.Sequential(
        nn.Linear(config.hidden_size, config.intermediate_size),
        nn.LayerNorm(config.intermediate_size),
        nn.GELU(),
        nn.Linear(config.intermediate_size, config.hidden_size),
    )
""",
}


def mlp_variant(source: str, name: str) -> str:
    """modeling_tinyllama_renamed.py's text with its FeedForward rewritten as ``name``."""
    assert source.count(CLASS) == 1
    return source.replace(CLASS, VARIANTS[name])


# tinymoe's sparse block with a shared expert beside its experts: a clamped SwiGLU on one
# [gate; up] Linear (MiniMax-M3's shared expert), summed with the experts' output
_SHARED = """class TinyMoeSharedExpert(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up = nn.Linear(config.hidden_size, 2 * config.moe_intermediate_size, bias=False)
        self.down = nn.Linear(config.moe_intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        gate = gate.clamp(max=7.0)
        return self.down((up.clamp(-7.0, 7.0) + 1.0) * gate * torch.sigmoid(1.702 * gate))


"""
_EXPERTS = (
    "        self.experts = nn.ModuleList([TinyMoeExpert(config) for _ in range(config.num_experts)])\n"
)
_RETURN = "        return out.view(b, t, h)\n"


def clamped_shared_expert(source: str) -> str:
    """modeling_tinymoe.py's text with a clamped-SwiGLU shared expert beside the experts."""
    assert source.count(_EXPERTS) == 1 and source.count(_RETURN) == 1
    source = source.replace(
        "class TinyMoeSparseBlock(nn.Module):", _SHARED + "class TinyMoeSparseBlock(nn.Module):"
    )
    source = source.replace(_EXPERTS, _EXPERTS + "        self.shared_expert = TinyMoeSharedExpert(config)\n")
    return source.replace(_RETURN, "        return out.view(b, t, h) + self.shared_expert(x)\n")


_ROUTING = """        b, t, h = x.shape
        flat = x.reshape(-1, h)
        probs = F.softmax(self.router(flat), dim=-1, dtype=torch.float32)
"""
_LOOP_END = "        return out.view(b, t, h)\n"
# a routing vLLM's fused MoE does not compute (a softmax at temperature 0.7), each expert run
# on every token and weighted densely: one graph for torch.compile, kept from the source
_DENSE_FORWARD = """        probs = F.softmax(self.router(x) / 0.7, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        dense = torch.zeros_like(probs).scatter(-1, chosen, weights).to(x.dtype)
        outs = torch.stack([expert(x) for expert in self.experts], dim=-1)
        return (outs * dense.unsqueeze(-2)).sum(-1)
"""


def tempered_moe(source: str, dense: bool) -> str:
    """modeling_tinymoe.py's text with its router's softmax at temperature 0.7: the experts
    computed densely (``dense``), or in its loop over the experts the tokens chose, made to
    run on vLLM's flat [tokens, hidden] batch."""
    assert source.count(_ROUTING) == 1 and source.count(_LOOP_END) == 1
    if dense:
        start, end = source.index(_ROUTING), source.index(_LOOP_END) + len(_LOOP_END)
        return source[:start] + _DENSE_FORWARD + source[end:]
    routing = _ROUTING.replace("b, t, h = x.shape", "h = x.shape[-1]").replace("(flat)", "(flat) / 0.7")
    return source.replace(_ROUTING, routing).replace(_LOOP_END, "        return out.view(x.shape)\n")
