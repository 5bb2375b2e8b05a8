"""fuse_qkv: q/k/v linears -> QKVParallelLinear + split."""

import dataclasses

import pytest
from harness import assert_rewrites, rewrite
from hfrewrite.passes import fuse_qkv
from plans import llama_like

from hfrewrite.errors import HfrewriteError

BEFORE_LLAMA_ATTENTION = """\
class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)

    def forward(self, hidden_states):
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        value_states = self.v_proj(hidden_states).view(hidden_shape)
        return query_states, key_states, value_states
"""

AFTER_LLAMA_ATTENTION = """\
class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.head_dim = config.head_dim
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads = config.num_attention_heads
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
            bias=config.attention_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )

    def forward(self, hidden_states):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_states = q.view(hidden_shape)
        key_states = k.view(hidden_shape)
        value_states = v.view(hidden_shape)
        return query_states, key_states, value_states
"""


def test_llama_attention():
    assert_rewrites(fuse_qkv, BEFORE_LLAMA_ATTENTION, AFTER_LLAMA_ATTENTION, llama_like())


REFUSED_DIFFERENT_BIAS = """\
class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)

    def forward(self, hidden_states):
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        value_states = self.v_proj(hidden_states).view(hidden_shape)
        return query_states, key_states, value_states
"""


def test_refuses_different_bias():
    with pytest.raises(HfrewriteError, match="differ in their bias"):
        rewrite(fuse_qkv, REFUSED_DIFFERENT_BIAS, llama_like())


REFUSED_K_V_DIFFER = """\
class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias)

    def forward(self, hidden_states):
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        value_states = self.v_proj(hidden_states).view(hidden_shape)
        return query_states, key_states, value_states
"""


def test_refuses_k_v_differ():
    with pytest.raises(HfrewriteError, match="differ in out_features"):
        rewrite(fuse_qkv, REFUSED_K_V_DIFFER, llama_like())


REFUSED_Q_CALLED_TWICE = """\
class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)

    def forward(self, hidden_states):
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        value_states = self.v_proj(hidden_states).view(hidden_shape)
        return self.q_proj(hidden_states), key_states, value_states
"""


def test_refuses_q_called_twice():
    with pytest.raises(HfrewriteError, match="called once"):
        rewrite(fuse_qkv, REFUSED_Q_CALLED_TWICE, llama_like())


REFUSED_NOT_HEADS_TIMES_HEAD_DIM = """\
class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)

    def forward(self, hidden_states):
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        value_states = self.v_proj(hidden_states).view(hidden_shape)
        return query_states, key_states, value_states
"""


def test_refuses_not_heads_times_head_dim():
    with pytest.raises(HfrewriteError, match="heads \\* head_dim"):
        rewrite(fuse_qkv, REFUSED_NOT_HEADS_TIMES_HEAD_DIM, llama_like())


REFUSED_Q_HEAD_DIM_DIFFERS = """\
class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.qk_head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)

    def forward(self, hidden_states):
        return self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
"""


def test_refuses_q_head_dim_differing_from_k_v():
    # one head_size for all three in QKVParallelLinear: a q head size of its own is refused
    with pytest.raises(
        HfrewriteError,
        match=r"q/k/v differ in head_dim \(self.qk_head_dim, self.head_dim",
    ):
        rewrite(fuse_qkv, REFUSED_Q_HEAD_DIM_DIFFERS, llama_like())


DEFAULT_BIAS = BEFORE_LLAMA_ATTENTION.replace(", bias=config.attention_bias)", ")")


def test_linear_without_bias_argument_keeps_torch_default_bias_true():
    # nn.Linear's bias defaults to True: the fused layer must hold one too
    after = rewrite(fuse_qkv, DEFAULT_BIAS, llama_like())
    assert after == AFTER_LLAMA_ATTENTION.replace("bias=config.attention_bias,", "bias=True,")


@pytest.mark.parametrize("cls", ["nn.LoRALinear", "torch.nn.Linear"])  # names sorting after nn.Linear
def test_refuses_a_projection_of_another_class(cls):
    source = BEFORE_LLAMA_ATTENTION.replace("self.k_proj = nn.Linear(", f"self.k_proj = {cls}(")
    with pytest.raises(HfrewriteError, match="is not built with nn.Linear"):
        rewrite(fuse_qkv, source, llama_like())


# ERNIE-4.5's remote code: the out sizes computed beforehand, in branches
BEFORE_SIZES_COMPUTED = """\
class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        if config.head_dim is None:
            self.head_dim = config.hidden_size // config.num_attention_heads
        else:
            self.head_dim = config.head_dim
        q_hidden_size = self.head_dim * config.num_attention_heads
        kv_hidden_size = self.head_dim * config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, q_hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_hidden_size, bias=False)

    def forward(self, hidden_states):
        return self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
"""

AFTER_SIZES_COMPUTED = """\
class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        if config.head_dim is None:
            self.head_dim = config.hidden_size // config.num_attention_heads
        else:
            self.head_dim = config.head_dim
        q_hidden_size = self.head_dim * config.num_attention_heads
        kv_hidden_size = self.head_dim * config.num_key_value_heads
        tp_size = get_tensor_model_parallel_world_size()
        head_size = (q_hidden_size) // config.num_attention_heads
        self.total_num_heads = config.num_attention_heads
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
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        self.qkv_proj = QKVParallelLinear(
            hidden_size=config.hidden_size,
            head_size=head_size,
            total_num_heads=self.total_num_heads,
            total_num_kv_heads=self.total_num_kv_heads,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )

    def forward(self, hidden_states):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v
"""


def _with_head_fields():
    plan = llama_like()
    fields = {"heads_field": "num_attention_heads", "kv_heads_field": "num_key_value_heads"}
    return dataclasses.replace(plan, attention=dataclasses.replace(plan.attention, **fields))


def test_sizes_computed_elsewhere_come_from_the_proven_config_fields():
    """Head counts from the config fields the analysis proved hold them; the head size is
    the q projection's own size over that count (self.head_dim, set in a branch, is seen)."""
    assert_rewrites(fuse_qkv, BEFORE_SIZES_COMPUTED, AFTER_SIZES_COMPUTED, _with_head_fields())


def test_sizes_computed_elsewhere_without_proven_fields_are_refused():
    with pytest.raises(HfrewriteError, match="no config field of __init__ was proven"):
        rewrite(fuse_qkv, BEFORE_SIZES_COMPUTED, llama_like())


BEFORE_SIZES_GIVEN = """\
class LlamaAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, bias=True):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(self, hidden_states):
        return self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
"""


def test_sizes_given_to_init_come_from_its_own_parameters():
    """XGLM: no config reaches the attention; the head counts are the parameter the analysis
    proved holds them, and the head size the q projection's size over it."""
    plan = _with_head_fields()
    plan = dataclasses.replace(
        plan, attention=dataclasses.replace(plan.attention, heads_expr="num_heads", kv_heads_expr="num_heads")
    )
    after = rewrite(fuse_qkv, BEFORE_SIZES_GIVEN, plan)
    assert "head_size = (embed_dim) // num_heads\n" in after
    assert "self.total_num_heads = num_heads\n" in after and "self.total_num_kv_heads = num_heads\n" in after
    assert "config." not in after
