"""An attention's proven output gate across the passes: vllm_attention computes it after
vLLM's attention (per lane or per head, in float32 where the source is), row_parallel shards
its projection as the heads are; fuse_qkv sizes what __init__ builds after the head sharding
by the whole head counts, while forward keeps each rank's."""

import dataclasses

from harness import assert_rewrites
from hfrewrite.passes import fuse_qkv, row_parallel, vllm_attention
from plans import llama_like

from hfrewrite.analyze.output_gates import GateActivation, OutputGate


def gated(activation=GateActivation.SIGMOID, per_head=False, upcast=False):
    plan = llama_like()
    gate = OutputGate("g_proj", 128, 4 if per_head else 128, False, activation, per_head, upcast)
    return dataclasses.replace(plan, attention=dataclasses.replace(plan.attention, output_gate=gate))


BEFORE_ATTENTION = """\
class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.scaling = self.head_dim**-0.5

    def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_states = q.view(hidden_shape).transpose(1, 2)
        key_states = k.view(hidden_shape).transpose(1, 2)
        value_states = v.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask, scaling=self.scaling, **kwargs
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        {gate_lines}
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights
"""

AFTER_ATTENTION = """\
class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.scaling = self.head_dim**-0.5
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=config.rope_parameters,
            is_neox_style=True,
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.scaling,
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)
{gate_lines}        attn_output = self.o_proj(attn_output)
        return attn_output
"""

SIGMOID_PER_LANE = """\
        # The source's output gate (proven by replay): attention output x sigmoid(g_proj(x)), per lane.
        gate = self.g_proj(hidden_states)
        gate = torch.sigmoid(gate)
        attn_output = attn_output * gate
"""

SOFTPLUS_PER_HEAD_FLOAT32 = """\
        # The source's output gate (proven by replay): attention output x softplus(g_proj(x)), per head.
        gate = self.g_proj(hidden_states)
        gate = torch.nn.functional.softplus(gate.float()).to(attn_output.dtype)
        attn_output = (
            attn_output.view(*attn_output.shape[:-1], -1, self.head_dim) * gate.unsqueeze(-1)
        ).view(attn_output.shape)
"""


def test_a_gate_per_lane_follows_vllm_attention():
    before = BEFORE_ATTENTION.replace(
        "{gate_lines}", "attn_output = attn_output * torch.sigmoid(self.g_proj(hidden_states))"
    )
    assert_rewrites(
        vllm_attention, before, AFTER_ATTENTION.replace("{gate_lines}", SIGMOID_PER_LANE), gated()
    )


def test_a_gate_per_head_in_float32_follows_vllm_attention():
    before = BEFORE_ATTENTION.replace(
        "{gate_lines}",
        "gate = F.softplus(self.g_proj(hidden_states).float()).to(attn_output.dtype)\n"
        "        attn_output = (attn_output.view(*input_shape, -1, self.head_dim) * gate.unsqueeze(-1)).view(*input_shape, -1)",
    )
    plan = gated(GateActivation.SOFTPLUS, per_head=True, upcast=True)
    assert_rewrites(
        vllm_attention, before, AFTER_ATTENTION.replace("{gate_lines}", SOFTPLUS_PER_HEAD_FLOAT32), plan
    )


BEFORE_GATE_PROJECTION = """\
class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.o_proj = nn.Linear(self.total_num_heads * self.head_dim, config.hidden_size, bias=False)
        self.g_proj = nn.Linear(config.hidden_size, self.total_num_heads, bias=False)

    def forward(self, hidden_states, attn_output):
        gate = self.g_proj(hidden_states)
        attn_output = self.o_proj(attn_output * gate)
        return attn_output
"""

AFTER_GATE_PROJECTION = """\
class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            config.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.g_proj = ColumnParallelLinear(
            config.hidden_size,
            self.total_num_heads,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.g_proj",
        )

    def forward(self, hidden_states, attn_output):
        gate, _ = self.g_proj(hidden_states)
        attn_output, _ = self.o_proj(attn_output * gate)
        return attn_output
"""


def test_the_gate_projection_is_column_parallel():
    plan = gated(per_head=True)
    plan = dataclasses.replace(plan, mlp=None)
    assert_rewrites(row_parallel, BEFORE_GATE_PROJECTION, AFTER_GATE_PROJECTION, plan)


BEFORE_HEAD_COUNTS = """\
class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.per_head = config.gating == "per-head"
        g_size = self.num_heads if self.per_head else self.num_heads * self.head_dim
        self.g_proj = nn.Linear(config.hidden_size, g_size, bias=False)
        if config.qk_layernorm:
            self.q_norm = PerHeadNorm(self.head_dim, self.num_heads)
        self.heads_per_rank = self.num_heads

    def forward(self, hidden_states):
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        value_states = self.v_proj(hidden_states).view(hidden_shape)
        return query_states, key_states, value_states
"""

AFTER_HEAD_COUNTS = """\
class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = config.head_dim
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads = self.num_heads
        self.total_num_kv_heads = config.num_key_value_heads
        # Heads are sharded over tensor-parallel ranks; kv heads are replicated when
        # there are fewer of them than ranks.
        assert self.total_num_heads % tp_size == 0
        if self.total_num_kv_heads >= tp_size:
            assert self.total_num_kv_heads % tp_size == 0
        else:
            assert tp_size % self.total_num_kv_heads == 0
        self.num_heads = self.total_num_heads // tp_size
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            hidden_size=config.hidden_size,
            head_size=self.head_dim,
            total_num_heads=self.total_num_heads,
            total_num_kv_heads=self.total_num_kv_heads,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = nn.Linear(self.total_num_heads * self.head_dim, config.hidden_size, bias=False)
        self.per_head = config.gating == "per-head"
        g_size = self.total_num_heads if self.per_head else self.total_num_heads * self.head_dim
        self.g_proj = nn.Linear(config.hidden_size, g_size, bias=False)
        if config.qk_layernorm:
            self.q_norm = PerHeadNorm(self.head_dim, self.total_num_heads)
        self.heads_per_rank = self.num_heads

    def forward(self, hidden_states):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_states = q.view(hidden_shape)
        key_states = k.view(hidden_shape)
        value_states = v.view(hidden_shape)
        return query_states, key_states, value_states
"""


def test_modules_built_after_the_head_sharding_take_the_whole_head_counts():
    # (an attribute forward reads, heads_per_rank, keeps the rank's count)
    assert_rewrites(fuse_qkv, BEFORE_HEAD_COUNTS, AFTER_HEAD_COUNTS, llama_like())


def packed():
    plan = llama_like()
    gate = OutputGate("q_proj", 128, 256, False, GateActivation.SIGMOID, False, False, packed=True)
    # the analysis accounts for the chunk taking each head apart, as it does on Qwen3.5's trace
    calls = (*plan.attention.replaced_calls, "chunk")
    attention = dataclasses.replace(plan.attention, output_gate=gate, replaced_calls=calls)
    return dataclasses.replace(plan, attention=attention)


def test_a_gate_packed_in_q_proj_is_taken_apart_after_the_split():
    """Qwen3-Next's gate: q_proj's second half of each head. The split takes twice q's size,
    each head is taken apart before the rope; the gate multiplies vLLM's attention output."""
    before = BEFORE_ATTENTION.replace(
        "        query_states = q.view(hidden_shape).transpose(1, 2)\n",
        "        query_states, gate = torch.chunk(q.view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)\n"
        "        gate = gate.reshape(*input_shape, -1)\n"
        "        query_states = query_states.reshape(hidden_shape).transpose(1, 2)\n",
    ).replace("{gate_lines}", "attn_output = attn_output * torch.sigmoid(gate)")
    before = before.replace(
        "q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)",
        "q, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)",
    )
    after = AFTER_ATTENTION.replace(
        "        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)\n",
        "        q, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)\n"
        "        # Each head's q and output gate side by side in the projection, as in the source.\n"
        "        q, gate = q.view(*q.shape[:-1], -1, 2 * self.head_dim).chunk(2, dim=-1)\n"
        "        q = q.reshape(*q.shape[:-2], -1)\n"
        "        gate = gate.reshape(*gate.shape[:-2], -1)\n",
    ).replace(
        "{gate_lines}",
        "        # The source's output gate (proven by replay): attention output x sigmoid(gate), "
        "the gate packed per head beside q in q_proj.\n"
        "        gate = torch.sigmoid(gate)\n"
        "        attn_output = attn_output * gate\n",
    )
    assert_rewrites(vllm_attention, before, after, packed())


PACKED_INIT = """\
class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)

    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        return q, k, v
"""


def test_fuse_qkv_builds_twice_the_query_heads_for_a_packed_gate():
    """Each rank's q shard keeps whole heads with their gates: QKVParallelLinear over twice the
    query heads; the split takes twice q's size; the rank's own head count stays the heads'."""
    from harness import apply

    out = apply(fuse_qkv, PACKED_INIT, packed()).module.code
    assert "self.total_num_heads = config.num_attention_heads\n" in out
    assert "total_num_heads=self.total_num_heads * 2," in out
    assert "# q's projection holds each head's q and output gate side by side" in out
    assert "q, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)" in out
    assert "self.q_size = self.num_heads * self.head_dim\n" in out
