"""The carried-source paths: a decoder layer's forward kept as written, checkpoint-fused
projections, ungated MLPs, and source helpers re-imported (before/after pairs, refusals)."""

import dataclasses

import pytest
from harness import assert_rewrites, rewrite
from hfrewrite.passes import (
    carry_decoder_layer,
    fuse_gate_up,
    fuse_qkv,
    row_parallel,
    strip_hf_runtime,
)
from plans import llama_like

from hfrewrite.analyze.mlp_forms import MlpForm
from hfrewrite.analyze.plan import DecoderLayerPlan, LinearFact, MlpPlan
from hfrewrite.analyze.qkv_layouts import QkvLayout
from hfrewrite.errors import HfrewriteError

CARRIED = DecoderLayerPlan("Gemma2DecoderLayer", (), attention_block="self_attn", mlp_block="mlp")


def carried_plan():
    plan = llama_like("Gemma2", "gemma2")
    return dataclasses.replace(
        plan,
        decoder_layer=CARRIED,
        attention=dataclasses.replace(plan.attention, module_class="Gemma2Attention"),
    )


ATTENTION = """\
class Gemma2Attention(nn.Module):
    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        return hidden_states, None

"""

BEFORE_SANDWICH_LAYER = (
    ATTENTION
    + """
class Gemma2DecoderLayer(nn.Module):
    def forward(self, hidden_states, position_embeddings, attention_mask=None, position_ids=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **kwargs,
        )
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return residual + self.post_feedforward_layernorm(hidden_states)
"""
)

AFTER_SANDWICH_LAYER = (
    ATTENTION
    + """
class Gemma2DecoderLayer(nn.Module):
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return residual + self.post_feedforward_layernorm(hidden_states)
"""
)


def test_sandwich_layer_is_carried_as_written():
    assert_rewrites(carry_decoder_layer, BEFORE_SANDWICH_LAYER, AFTER_SANDWICH_LAYER, carried_plan())


def test_attention_input_is_found_by_keyword_in_any_order():
    source = BEFORE_SANDWICH_LAYER.replace(
        "            hidden_states=hidden_states,\n            position_embeddings=position_embeddings,\n",
        "            position_embeddings=position_embeddings,\n            hidden_states=hidden_states,\n",
    )
    assert_rewrites(carry_decoder_layer, source, AFTER_SANDWICH_LAYER, carried_plan())


def test_attention_result_bound_twice_is_refused():
    # `x, _ = kept = self.self_attn(...)` also keeps the tuple: not the `x, _ = ...` shape
    source = BEFORE_SANDWICH_LAYER.replace(
        "hidden_states, _ = self.self_attn(",
        "hidden_states, _ = kept = self.self_attn(",
    )
    with pytest.raises(HfrewriteError, match="the attention result is not taken as"):
        rewrite(carry_decoder_layer, source, carried_plan())


def test_fused_layer_is_not_touched():
    plan = dataclasses.replace(carried_plan(), decoder_layer=llama_like().decoder_layer)
    assert_rewrites(carry_decoder_layer, BEFORE_SANDWICH_LAYER, BEFORE_SANDWICH_LAYER, plan)


PARALLEL_LAYER_POSITIONAL = (
    ATTENTION
    + """
class Gemma2DecoderLayer(nn.Module):
    def forward(self, hidden_states, attention_mask=None, **kwargs):
        attn_output = self.self_attn(self.input_layernorm(hidden_states), attention_mask=attention_mask)[0]
        return attn_output + self.mlp(self.input_layernorm(hidden_states)) + hidden_states
"""
)


def test_positional_hidden_states_and_first_result():
    out = rewrite(carry_decoder_layer, PARALLEL_LAYER_POSITIONAL, carried_plan())
    assert (
        "attn_output = self.self_attn(positions=positions, "
        "hidden_states=self.input_layernorm(hidden_states))\n"
    ) in out


@pytest.mark.parametrize(
    "old, new, match",
    [
        # the attention weights are read later: vLLM has none
        (
            "hidden_states, _ = self.self_attn(",
            "hidden_states, weights = self.self_attn(",
            "reads weights",
        ),
        # a dropped Hugging Face input is still read
        (
            "residual = hidden_states\n",
            "residual = hidden_states * position_ids\n",
            "reads position_ids",
        ),
    ],
)
def test_carry_refusals(old, new, match):
    source = BEFORE_SANDWICH_LAYER.replace(old, new, 1)
    if "weights" in new:
        source = source.replace("return residual +", "return weights + residual +")
    with pytest.raises(HfrewriteError, match=match):
        rewrite(carry_decoder_layer, source, carried_plan())


BEFORE_FUSED_QKV = """\
class Phi3Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        op_size = config.num_attention_heads * self.head_dim + 2 * (config.num_key_value_heads * self.head_dim)
        self.qkv_proj = nn.Linear(config.hidden_size, op_size, bias=False)

    def forward(self, hidden_states):
        qkv = self.qkv_proj(hidden_states)
        query_pos = self.config.num_attention_heads * self.head_dim
        query_states = qkv[..., :query_pos]
        key_states = qkv[..., query_pos : query_pos + self.num_key_value_heads * self.head_dim]
        value_states = qkv[..., query_pos + self.num_key_value_heads * self.head_dim :]
        return query_states, key_states, value_states
"""


def fused_qkv_plan(per_head=False):
    plan = llama_like("Phi3", "phi3")
    fact = LinearFact("qkv_proj", 128, 128, False)
    att = dataclasses.replace(
        plan.attention,
        q=fact,
        k=fact,
        v=fact,
        qkv_layout=QkvLayout.PER_HEAD if per_head else QkvLayout.BLOCKS,
        heads_field="num_attention_heads",
        kv_heads_field="num_key_value_heads",
    )
    return dataclasses.replace(plan, attention=att)


def test_checkpoint_fused_qkv_keeps_its_name_and_splits_by_role():
    out = rewrite(fuse_qkv, BEFORE_FUSED_QKV, fused_qkv_plan())
    assert "self.qkv_proj = QKVParallelLinear(" in out
    # sizes and bias read from nn.Linear's positional arguments
    assert "hidden_size=config.hidden_size,\n" in out and "bias=False,\n" in out
    assert "self.total_num_kv_heads = config.num_key_value_heads\n" in out
    assert (
        "qkv, _ = self.qkv_proj(hidden_states)\n"
        "        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)\n"
    ) in out
    assert "query_states = q\n" in out and "key_states = k\n" in out and "value_states = v\n" in out


def test_kv_heads_from_the_sources_expression_and_set_once_per_rank():
    # Falcon-7B: no config field holds its one kv head; the source sets the total again after
    # the projection, which would undo the per-rank count
    source = BEFORE_FUSED_QKV.replace(
        "bias=False)\n",
        "bias=False)\n        self.num_kv_heads = config.num_kv_heads if not config.multi_query else 1\n",
    )
    plan = fused_qkv_plan()
    expr = "config.num_kv_heads if not config.multi_query else 1"
    att = dataclasses.replace(plan.attention, kv_heads_field=None, kv_heads_expr=expr)
    out = rewrite(fuse_qkv, source, dataclasses.replace(plan, attention=att))
    assert f"self.total_num_kv_heads = {expr}\n" in out
    assert out.count("self.num_kv_heads = ") == 1  # max(1, total // tp_size) only
    # a layout reordered when loaded needs the field itself (load_weights reads the config)
    per_head = dataclasses.replace(att, qkv_layout=QkvLayout.PER_HEAD)
    with pytest.raises(HfrewriteError, match="no config fields hold the head counts"):
        rewrite(fuse_qkv, source, dataclasses.replace(plan, attention=per_head))


def test_checkpoint_fused_qkv_refuses_an_unsliced_use():
    source = BEFORE_FUSED_QKV.replace("return query_states,", "return qkv, query_states,")
    with pytest.raises(HfrewriteError, match="used beyond its q/k/v split"):
        rewrite(fuse_qkv, source, fused_qkv_plan())


BEFORE_PER_HEAD_QKV = """\
class GPTNeoXAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.head_size = config.hidden_size // config.num_attention_heads
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)

    def forward(self, hidden_states):
        qkv = self.query_key_value(hidden_states).view(hidden_shape).transpose(1, 2)
        query_states, key_states, value_states = qkv.chunk(3, dim=-1)
        return query_states
"""


def test_per_head_qkv_derives_the_head_size_and_unchunks():
    plan = fused_qkv_plan(per_head=True)
    fact = LinearFact("query_key_value", 128, 128, True)
    plan = dataclasses.replace(
        plan,
        attention=dataclasses.replace(
            plan.attention, module_class="GPTNeoXAttention", q=fact, k=fact, v=fact
        ),
    )
    out = rewrite(fuse_qkv, BEFORE_PER_HEAD_QKV, plan)
    assert (
        "self.head_dim = (3 * config.hidden_size) // (self.total_num_heads + 2 * self.total_num_kv_heads)"
        in out
    )
    assert "query_states, key_states, value_states = q, k, v\n" in out
    assert "interleaves q, k and v per head" in out


BEFORE_FUSED_GATE_UP = """\
class Phi3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.activation_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states):
        up_states = self.gate_up_proj(hidden_states)
        gate, up_states = up_states.chunk(2, dim=-1)
        up_states = up_states * self.activation_fn(gate)
        return self.down_proj(up_states)
"""

AFTER_FUSED_GATE_UP = """\
class Phi3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        # The checkpoint holds gate and up in one tensor, which this layer loads as it is.
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [config.intermediate_size] * 2,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.activation_fn = get_act_and_mul_fn(config.hidden_act)

    def forward(self, hidden_states):
        gate_up, _ = self.gate_up_proj(hidden_states)
        return self.down_proj(self.activation_fn(gate_up))
"""


def test_checkpoint_fused_gate_up():
    fact = LinearFact("gate_up_proj", 128, 256, False)
    mlp = MlpPlan(
        "Phi3MLP",
        fact,
        fact,
        LinearFact("down_proj", 256, 128, False),
        "activation_fn",
        "silu",
        fused_gate_up=True,
    )
    plan = dataclasses.replace(llama_like("Phi3", "phi3"), mlp=mlp)
    assert_rewrites(fuse_gate_up, BEFORE_FUSED_GATE_UP, AFTER_FUSED_GATE_UP, plan)


BEFORE_SWIGLU_CLOSURE = """\
class MLP(nn.Module):
    def __init__(self, config, device=None):
        super().__init__()
        self.add_bias = config.add_bias_linear
        self.dense_h_to_4h = nn.Linear(
            config.hidden_size, config.ffn_hidden_size * 2, bias=self.add_bias, device=device
        )

        def swiglu(x):
            x = torch.chunk(x, 2, dim=-1)
            return F.silu(x[0]) * x[1]

        self.activation_func = swiglu
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=self.add_bias)

    def forward(self, hidden_states):
        intermediate_parallel = self.activation_func(self.dense_h_to_4h(hidden_states))
        return self.dense_4h_to_h(intermediate_parallel)
"""

AFTER_SWIGLU_CLOSURE = """\
class MLP(nn.Module):
    def __init__(self, config, device=None):
        super().__init__()
        self.add_bias = config.add_bias_linear
        # The checkpoint holds gate and up in one tensor, which this layer loads as it is.
        self.dense_h_to_4h = MergedColumnParallelLinear(
            config.hidden_size,
            [config.ffn_hidden_size] * 2,
            bias=self.add_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.dense_h_to_4h",
        )

        def swiglu(x):
            x = torch.chunk(x, 2, dim=-1)
            return F.silu(x[0]) * x[1]

        self.activation_func = swiglu
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=self.add_bias)
        self.act_fn = get_act_and_mul_fn("silu")

    def forward(self, hidden_states):
        gate_up, _ = self.dense_h_to_4h(hidden_states)
        return self.dense_4h_to_h(self.act_fn(gate_up))
"""


def test_checkpoint_fused_gate_up_with_torchs_activation_in_a_closure():
    # ChatGLM3: `nn.Linear(H, I * 2)`, its activation torch's silu in a closure; vLLM's act_fn beside it
    fact = LinearFact("dense_h_to_4h", 128, 256, False)
    mlp = MlpPlan(
        "MLP", fact, fact, LinearFact("dense_4h_to_h", 256, 128, False), "", "silu", fused_gate_up=True
    )
    plan = dataclasses.replace(llama_like("ChatGLM", "chatglm"), mlp=mlp)
    assert_rewrites(fuse_gate_up, BEFORE_SWIGLU_CLOSURE, AFTER_SWIGLU_CLOSURE, plan)


BEFORE_UNGATED_MLP = """\
class ArceeMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)))
"""


def ungated_plan():
    mlp = MlpPlan(
        "ArceeMLP",
        None,
        LinearFact("up_proj", 128, 256, False),
        LinearFact("down_proj", 256, 128, False),
        "act_fn",
        "ReLUSquaredActivation",
        form=MlpForm.UNGATED,
    )
    return dataclasses.replace(llama_like("Arcee", "arcee"), mlp=mlp)


def test_ungated_mlp_is_column_then_row_parallel_with_the_source_activation():
    source = (
        BEFORE_UNGATED_MLP + "\n\nclass ArceeAttention(nn.Module):\n    def __init__(self, config):\n"
        "        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)\n"
    )
    plan = dataclasses.replace(
        ungated_plan(),
        attention=dataclasses.replace(ungated_plan().attention, module_class="ArceeAttention"),
    )
    out = rewrite(row_parallel, source, plan)
    assert "self.up_proj = ColumnParallelLinear(" in out and "self.down_proj = RowParallelLinear(" in out
    assert "return self.down_proj(self.act_fn(self.up_proj(x)[0]))[0]" in out
    assert "self.act_fn = ACT2FN[config.hidden_act]" in out
    # fuse_gate_up leaves an ungated MLP alone
    assert_rewrites(fuse_gate_up, BEFORE_UNGATED_MLP, BEFORE_UNGATED_MLP, ungated_plan())


def test_helpers_the_carried_source_uses_are_imported_absolutely():
    source = """\
from ...activations import ACT2FN
from ...modeling_utils import PreTrainedModel
from .configuration_arcee import ArceeConfig
import torch


class ArceeForCausalLM(PreTrainedModel):
    def __init__(self, config: ArceeConfig):
        super().__init__(config)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.act(x)
"""
    out = rewrite(strip_hf_runtime, source, dataclasses.replace(llama_like("Arcee", "arcee")))
    assert "from transformers.activations import ACT2FN\n" in out
    assert "from transformers import ArceeConfig\n" in out
    assert "PreTrainedModel" not in out


def test_hidden_states_under_another_name():
    # the layer's first parameter is the stream, whatever it is called (`x` sorts after "self")
    layer = BEFORE_SANDWICH_LAYER[len(ATTENTION) :].replace(
        "def forward(self, hidden_states, position_embeddings,",
        "def forward(self, x, position_embeddings,",
    )
    source = ATTENTION + layer.replace(
        "residual = hidden_states\n        hidden_states = self.input_layernorm(hidden_states)",
        "residual = x\n        hidden_states = self.input_layernorm(x)",
    )
    out = rewrite(carry_decoder_layer, source, carried_plan())
    assert "def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:" in out


def test_a_layer_without_kwargs_is_carried():
    source = BEFORE_SANDWICH_LAYER.replace(", position_ids=None, **kwargs):", ", position_ids=None):")
    source = source.replace("            **kwargs,\n", "")
    assert_rewrites(carry_decoder_layer, source, AFTER_SANDWICH_LAYER, carried_plan())


def test_reading_the_dropped_kwargs_is_refused():
    source = BEFORE_SANDWICH_LAYER.replace(
        "residual = hidden_states\n", "residual = hidden_states * kwargs['scale']\n", 1
    )
    with pytest.raises(HfrewriteError, match="reads kwargs"):
        rewrite(carry_decoder_layer, source, carried_plan())


def test_checkpoint_fused_qkv_sliced_without_an_ellipsis_is_refused():
    # qkv[:n] is not one of the [..., a:b] role slices: refused, not misread
    source = BEFORE_FUSED_QKV.replace("query_states = qkv[..., :query_pos]", "query_states = qkv[:query_pos]")
    with pytest.raises(HfrewriteError, match="is not sliced exactly into q, k and v"):
        rewrite(fuse_qkv, source, fused_qkv_plan())


def per_head_plan():
    plan = fused_qkv_plan(per_head=True)
    fact = LinearFact("query_key_value", 128, 128, True)
    return dataclasses.replace(
        plan,
        attention=dataclasses.replace(
            plan.attention, module_class="GPTNeoXAttention", q=fact, k=fact, v=fact
        ),
    )


@pytest.mark.parametrize(
    "other_split",
    [
        "a, b, c = hidden_states.chunk(3, dim=-1)",  # another tensor's chunk (its name sorts before qkv)
        "a, b, c = self.split_other(hidden_states)",  # a method of the module on another tensor
    ],
)
def test_per_head_qkv_unchunks_only_its_own_split(other_split):
    source = BEFORE_PER_HEAD_QKV.replace(
        "        return query_states\n",
        f"        {other_split}\n        return query_states\n",
    )
    out = rewrite(fuse_qkv, source, per_head_plan())
    assert "query_states, key_states, value_states = q, k, v\n" in out
    assert f"        {other_split}\n" in out


def test_other_subscripts_by_zero_are_not_the_attention_result():
    source = BEFORE_SANDWICH_LAYER.replace(
        "        residual = hidden_states\n",
        "        tokens = hidden_states.shape[0]\n        residual = hidden_states\n",
        1,
    )
    out = rewrite(carry_decoder_layer, source, carried_plan())
    assert "        tokens = hidden_states.shape[0]\n" in out


def test_named_attention_weights_and_a_tuple_mlp_result():
    # `out, attn_weights = self_attn(...)` leaves `_` free for the MoE block's router logits
    source = BEFORE_SANDWICH_LAYER.replace(
        "hidden_states, _ = self.self_attn(",
        "hidden_states, attn_weights = self.self_attn(",
    ).replace(
        "        hidden_states = self.mlp(self.pre_feedforward_layernorm(hidden_states))\n",
        "        hidden_states, _ = self.mlp(self.pre_feedforward_layernorm(hidden_states))\n",
    )
    out = rewrite(carry_decoder_layer, source, carried_plan())
    assert "        hidden_states, _ = self.mlp(self.pre_feedforward_layernorm(hidden_states))\n" in out


def test_per_head_qkv_chunked_in_two_is_refused():
    source = BEFORE_PER_HEAD_QKV.replace(
        "query_states, key_states, value_states = qkv.chunk(3, dim=-1)",
        "query_states, key_states = qkv.chunk(2, dim=-1)",
    )
    with pytest.raises(HfrewriteError, match="is not chunked once into q, k and v"):
        rewrite(fuse_qkv, source, per_head_plan())


HYBRID_BEFORE = (
    ATTENTION
    + """
class Gemma2Mamba(nn.Module):
    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        return hidden_states


class Gemma2DecoderLayer(nn.Module):
    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.mamba is not None:
            hidden_states = self.mamba(
                hidden_states=hidden_states,
                cache_params=past_key_values,
                attention_mask=attention_mask,
                **kwargs,
            )
        else:
            hidden_states, _ = self.self_attn(
                hidden_states=hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                **kwargs,
            )
        hidden_states = residual + hidden_states * self.residual_multiplier
        return hidden_states
"""
)

HYBRID_AFTER = (
    ATTENTION
    + """
class Gemma2Mamba(nn.Module):
    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        return hidden_states


class Gemma2DecoderLayer(nn.Module):
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.mamba is not None:
            hidden_states = self.mamba(hidden_states)
        else:
            hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states = residual + hidden_states * self.residual_multiplier
        return hidden_states
"""
)


def test_a_carried_hybrid_layer_calls_its_other_mixer_with_the_hidden_states_alone():
    """Granite-4.0-H: the mixer's cache and mask arguments go with the layer's dropped inputs."""
    from hfrewrite.analyze.plan import Mamba2Plan

    mixer = Mamba2Plan(module_class="Gemma2Mamba", attr="mamba", args=(), layer_test="self.mamba is not None")
    plan = dataclasses.replace(carried_plan(), mixer=mixer)
    assert_rewrites(carry_decoder_layer, HYBRID_BEFORE, HYBRID_AFTER, plan)
