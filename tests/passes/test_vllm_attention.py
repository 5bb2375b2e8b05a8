"""vllm_attention: HF attention interface -> vLLM Attention + get_rope."""

import dataclasses

import pytest
from harness import assert_rewrites, rewrite
from hfrewrite.passes import vllm_attention
from plans import llama_like

from hfrewrite.analyze.rope_styles import RopeLayers, RopeStyle
from hfrewrite.errors import HfrewriteError

BEFORE_SLIDING_WINDOW_CARRIED_OVER = """\
def rotate_half(x):
    return x


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.scaling = self.head_dim**-0.5
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_states = q.view(hidden_shape).transpose(1, 2)
        key_states = k.view(hidden_shape).transpose(1, 2)
        value_states = v.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            scaling=self.scaling, sliding_window=self.sliding_window, **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights
"""

AFTER_SLIDING_WINDOW_CARRIED_OVER = """\
def rotate_half(x):
    return x


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.scaling = self.head_dim**-0.5
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
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
            per_layer_sliding_window=self.sliding_window,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)
        attn_output = self.o_proj(attn_output)
        return attn_output
"""


def test_sliding_window_carried_over():
    assert_rewrites(
        vllm_attention, BEFORE_SLIDING_WINDOW_CARRIED_OVER, AFTER_SLIDING_WINDOW_CARRIED_OVER, llama_like()
    )


BEFORE_CLIP_QKV_CONDITIONAL_CARRIED_OVER = """\
def rotate_half(x):
    return x


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.scaling = self.head_dim**-0.5
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_states = q.view(hidden_shape).transpose(1, 2)
        key_states = k.view(hidden_shape).transpose(1, 2)
        value_states = v.view(hidden_shape).transpose(1, 2)
        if self.config.clip_qkv is not None:
            query_states.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
            value_states.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            scaling=self.scaling, sliding_window=self.sliding_window, **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights
"""

AFTER_CLIP_QKV_CONDITIONAL_CARRIED_OVER = """\
def rotate_half(x):
    return x


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.scaling = self.head_dim**-0.5
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
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
            per_layer_sliding_window=self.sliding_window,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.config.clip_qkv is not None:
            q.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
            v.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)
        attn_output = self.o_proj(attn_output)
        return attn_output
"""


def test_clip_qkv_conditional_carried_over():
    assert_rewrites(
        vllm_attention,
        BEFORE_CLIP_QKV_CONDITIONAL_CARRIED_OVER,
        AFTER_CLIP_QKV_CONDITIONAL_CARRIED_OVER,
        llama_like(),
    )


REFUSED_NO_SCALING = """\
def rotate_half(x):
    return x


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.scaling = self.head_dim**-0.5
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_states = q.view(hidden_shape).transpose(1, 2)
        key_states = k.view(hidden_shape).transpose(1, 2)
        value_states = v.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            sliding_window=self.sliding_window, **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights
"""


def test_refuses_no_scaling():
    with pytest.raises(HfrewriteError, match="scaling"):
        rewrite(vllm_attention, REFUSED_NO_SCALING, llama_like())


REFUSED_NOT_NEOX_ROPE = """\
def rotate_every_two(x):
    return x


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.scaling = self.head_dim**-0.5
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_states = q.view(hidden_shape).transpose(1, 2)
        key_states = k.view(hidden_shape).transpose(1, 2)
        value_states = v.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            scaling=self.scaling, sliding_window=self.sliding_window, **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights
"""


def test_rope_style_comes_from_the_plan_not_the_source():
    # no `rotate_half` in this source: the style is the analysis's proven fact
    for style in RopeStyle:
        neox = style.is_neox
        att = dataclasses.replace(llama_like().attention, rope_style=style)
        out = rewrite(
            vllm_attention,
            REFUSED_NOT_NEOX_ROPE,
            dataclasses.replace(llama_like(), attention=att),
        )
        assert f"is_neox_style={neox}," in out


def test_refuses_nope_attention():
    att = dataclasses.replace(llama_like().attention, rope_layers=RopeLayers.NONE)
    with pytest.raises(HfrewriteError, match="no rotary embedding on q and k, and no position table"):
        rewrite(
            vllm_attention,
            REFUSED_NOT_NEOX_ROPE,
            dataclasses.replace(llama_like(), attention=att),
        )


CONDITIONAL_ROPE = """\
def rotate_half(x):
    return x


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.scaling = self.head_dim**-0.5
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_states = q.view(hidden_shape).transpose(1, 2)
        key_states = k.view(hidden_shape).transpose(1, 2)
        value_states = v.view(hidden_shape).transpose(1, 2)
        if self.use_rope:
            cos, sin = position_embeddings
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            scaling=self.scaling, sliding_window=self.sliding_window, **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights
"""


def test_conditional_rope_keeps_the_source_condition():
    # NoPE layers (smollm3, cohere2): the rotary call sits under the source's own test
    out = rewrite(vllm_attention, CONDITIONAL_ROPE, llama_like())
    assert (
        "        if self.use_rope:  # layers without rope (NoPE), as in the source\n"
        "            q, k = self.rotary_emb(positions, q, k)\n" in out
    )


def test_refuses_nope_layers_without_a_source_condition():
    plan = llama_like()
    plan = dataclasses.replace(
        plan, attention=dataclasses.replace(plan.attention, rope_layers=RopeLayers.SOME)
    )
    source = CONDITIONAL_ROPE.replace("        if self.use_rope:\n            cos", "        cos").replace(
        "\n            query_states, key_states = apply",
        "\n        query_states, key_states = apply",
    )
    with pytest.raises(HfrewriteError, match="rope is unconditional"):
        rewrite(vllm_attention, source, plan)


REFUSED_CONDITIONAL_READS_A_STATE = """\
def rotate_half(x):
    return x


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.scaling = self.head_dim**-0.5
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_states = q.view(hidden_shape).transpose(1, 2)
        key_states = k.view(hidden_shape).transpose(1, 2)
        value_states = v.view(hidden_shape).transpose(1, 2)
        if query_states.max() > 1:
            query_states.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
            value_states.clamp_(min=-self.config.clip_qkv, max=self.config.clip_qkv)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            scaling=self.scaling, sliding_window=self.sliding_window, **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights
"""


def test_refuses_conditional_reads_a_state():
    with pytest.raises(HfrewriteError, match="would not: if query_states.max"):
        rewrite(vllm_attention, REFUSED_CONDITIONAL_READS_A_STATE, llama_like())


REFUSED_EXTRA_OP_ON_Q = """\
def rotate_half(x):
    return x


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.scaling = self.head_dim**-0.5
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_states = q.view(hidden_shape).transpose(1, 2)
        key_states = k.view(hidden_shape).transpose(1, 2)
        value_states = v.view(hidden_shape).transpose(1, 2)
        query_states = torch.clamp(query_states, -5, 5)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            scaling=self.scaling, sliding_window=self.sliding_window, **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights
"""


def test_refuses_extra_op_on_q():
    with pytest.raises(HfrewriteError, match="would not: query_states = torch.clamp"):
        rewrite(vllm_attention, REFUSED_EXTRA_OP_ON_Q, llama_like())


REFUSED_NO_SPLIT = """\
def rotate_half(x):
    return x


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.scaling = self.head_dim**-0.5
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        qkv, _ = self.qkv_proj(hidden_states)
        query_states = q.view(hidden_shape).transpose(1, 2)
        key_states = k.view(hidden_shape).transpose(1, 2)
        value_states = v.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            scaling=self.scaling, sliding_window=self.sliding_window, **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights
"""


def test_refuses_no_split():
    with pytest.raises(HfrewriteError, match="no q/k/v split"):
        rewrite(vllm_attention, REFUSED_NO_SPLIT, llama_like())


def test_a_config_switch_the_trace_left_off_is_guarded():
    # cohere's `use_qk_norm`: off in the traced config, so the file refuses configs turning it on
    source = BEFORE_SLIDING_WINDOW_CARRIED_OVER.replace(
        "        cos, sin = position_embeddings\n",
        "        if self.config.use_qk_norm:\n            query_states = self.q_norm(query_states)\n"
        "        cos, sin = position_embeddings\n",
    )
    out = rewrite(vllm_attention, source, llama_like())
    assert "use_qk_norm" in out and "self.q_norm(" not in out


@pytest.mark.parametrize(
    ("test", "switch"),
    [
        ('hasattr(self, "qk_norm")', True),  # Llama-4: fixed when the module is built
        ('hasattr(self, "qk_norm") and self.use_rope', True),
        ('hasattr(query_states, "qk_norm")', False),  # a test on a value, not on the module
        ("hasattr(self, name)", False),
    ],
)
def test_a_module_attribute_test_is_a_config_switch(test, switch):
    import libcst as cst

    from hfrewrite.emit.attention_body import config_switch

    statement = cst.parse_statement(f"if {test}:\n    x = 1\n")
    assert (config_switch(statement) is not None) is switch
