"""analyze(): the plan facts per model type and variant, errors, and NoMatch reasons."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from hfrewrite.analyze.attention import analyze_attention
from hfrewrite.analyze.decoder import analyze_decoder
from hfrewrite.analyze.manual_attention import NO_MIXER_REASON
from hfrewrite.analyze.mlp import analyze_mlp
from hfrewrite.analyze.mlp_forms import MlpForm
from hfrewrite.analyze.model import analyze
from hfrewrite.analyze.norm import analyze_norm, config_fields
from hfrewrite.analyze.norm_kinds import NormKind
from hfrewrite.analyze.plan import LinearFact, Mamba1Plan, NoMatch, NormPlan, ResidualBlock
from hfrewrite.analyze.qkv_layouts import QkvLayout
from hfrewrite.analyze.rope_styles import RopeLayers
from hfrewrite.analyze.trace import opaque_attention, trace
from hfrewrite.analyze.unconverted_mixers import KINDS
from hfrewrite.errors import HfrewriteError


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add contention
    yield
    torch.set_num_threads(threads)


def plan_of(model_type: str, **overrides):
    return analyze(transformers.AutoConfig.for_model(model_type, **overrides))


@pytest.mark.parametrize(
    "model_type, qkv_bias, q_norm, kv_heads, window",
    [
        ("llama", False, None, 4, None),  # defaults: kv heads == heads (MHA)
        ("mistral", False, None, 2, 4096),  # GQA, sliding window on every layer
        ("qwen2", True, None, 4, None),
        ("qwen3", False, "q_norm", 4, None),
    ],
)
def test_default_configs(model_type, qkv_bias, q_norm, kv_heads, window):
    plan = plan_of(model_type)
    prefix = {
        "llama": "Llama",
        "mistral": "Mistral",
        "qwen2": "Qwen2",
        "qwen3": "Qwen3",
    }[model_type]
    assert plan.model_type == model_type
    assert plan.architecture == f"{prefix}ForCausalLM"
    assert (plan.base_model_class, plan.base_model_attr) == (f"{prefix}Model", "model")
    assert (plan.embed_tokens, plan.layers, plan.final_norm, plan.lm_head) == (
        "embed_tokens",
        "layers",
        "norm",
        "lm_head",
    )
    assert plan.tie_word_embeddings is False
    assert plan.decoder_layer.module_class == f"{prefix}DecoderLayer"
    assert plan.decoder_layer.blocks == (
        ResidualBlock("input_layernorm", "self_attn"),
        ResidualBlock("post_attention_layernorm", "mlp"),
    )
    a = plan.attention
    assert a.module_class == f"{prefix}Attention"
    assert a.q == LinearFact("q_proj", 128, 128, qkv_bias)
    assert a.k == LinearFact("k_proj", 128, kv_heads * 32, qkv_bias)
    assert a.v == LinearFact("v_proj", 128, kv_heads * 32, qkv_bias)
    assert a.o == LinearFact("o_proj", 128, 128, False)
    assert (a.num_heads, a.num_kv_heads, a.head_dim) == (4, kv_heads, 32)
    assert (a.q_norm, a.k_norm) == (q_norm, q_norm and "k_norm")
    assert a.rope_layers is RopeLayers.ALL
    assert a.scaling == pytest.approx(32**-0.5)
    assert a.sliding_window == window
    m = plan.mlp
    assert (m.module_class, m.act_attr, m.activation) == (
        f"{prefix}MLP",
        "act_fn",
        "silu",
    )
    assert (m.gate, m.up, m.down) == (
        LinearFact("gate_proj", 128, 256, False),
        LinearFact("up_proj", 128, 256, False),
        LinearFact("down_proj", 256, 128, False),
    )
    assert plan.norm == NormPlan(f"{prefix}RMSNorm", NormKind.RMS, 1e-6)
    assert plan.declined == ()


def test_variants_biases_mqa_tying():
    plan = plan_of(
        "llama",
        attention_bias=True,
        mlp_bias=True,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        hidden_act="gelu",
        rms_norm_eps=1e-5,
    )
    a = plan.attention
    assert a.q.bias and a.k.bias and a.v.bias and a.o.bias
    assert (a.num_kv_heads, a.k.out_features) == (1, 32)
    assert plan.mlp.gate.bias and plan.mlp.down.bias and plan.mlp.activation == "gelu"
    assert plan.tie_word_embeddings is True
    assert plan.norm.eps == 1e-5


def test_explicit_head_dim_and_mha():
    # head_dim 128 * 16 heads != hidden 1024: shrunk to 64 * 4 heads != hidden 128
    plan = plan_of(
        "qwen3",
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=128,
    )
    a = plan.attention
    assert (a.num_heads, a.num_kv_heads, a.head_dim) == (4, 4, 64)
    assert (a.q.out_features, a.o.in_features, a.o.out_features) == (256, 256, 128)
    assert a.scaling == pytest.approx(64**-0.5)


def test_mixed_sliding_window_is_declined_not_fatal():
    plan = plan_of("qwen2", use_sliding_window=True, max_window_layers=2, sliding_window=16)
    assert plan.attention.sliding_window is None  # layer 0 is full attention
    assert plan.declined == (
        NoMatch(
            "uniform_sliding_window",
            "Qwen2Attention",
            "layers differ in sliding_window [None, 16]; the source's per-layer expression is carried",
        ),
    )


def test_linear_attention_model_is_refused():
    # recognised by its parts as a kind vLLM has a layer for that cannot run here
    with pytest.raises(HfrewriteError) as e:
        plan_of("kimi_linear")
    assert str(e.value) == ("kimi_linear: KimiLinearDeltaAttention: vllm_attention: " + KINDS[0].reason)


def test_a_model_of_selective_scans_alone_is_attention_free():
    # Mamba-1's layers: a norm and the mixer, no attention, no MLP
    plan = plan_of("mamba")
    assert plan.attention is None and isinstance(plan.mixer, Mamba1Plan)


def test_a_recurrent_mixer_of_no_known_kind_is_refused_as_such():
    with pytest.raises(HfrewriteError) as e:
        plan_of("recurrent_gemma")
    assert str(e.value) == (
        "recurrent_gemma: RecurrentGemmaRecurrentBlock: vllm_attention: " + NO_MIXER_REASON
    )


def test_a_scale_each_layer_computes_for_itself_is_carried():
    # GPT-2's scale_attn_by_inverse_layer_idx: layer i scales its scores by 1 / (i + 1), in
    # the `scaling=` its attention call passes, which the file carries per layer
    plan = plan_of("gpt2", scale_attn_by_inverse_layer_idx=True)
    assert plan.attention.attention_call.label == "attention interface"


def test_a_routers_softmax_is_not_taken_for_attention():
    # MiniMax's lightning-attention layers hold no attention call, and their MoE router
    # computes a softmax over a linear's logits: that is no attention form gone unrecognised;
    # the lightning block is the layer's mixer, under the child its attention layers use
    plan = plan_of("minimax")
    assert type(plan.mixer).__name__ == "LightningPlan" and plan.mixer.attr == "self_attn"
    assert plan.attention.module_class == "MiniMaxAttention" and plan.moe is not None
    assert plan.mixer.layer_test == "isinstance(self.self_attn, MiniMaxAttention)"


def test_activation_without_fused_kernel_keeps_its_act_between_column_shards():
    # vLLM has no ReLU *AndMul: relu(gate) * up stays as written, each rank on its columns
    mlp = plan_of("llama", hidden_act="relu").mlp
    assert mlp.form is MlpForm.PAIRWISE and not mlp.fused_gate_up
    assert mlp.form.column_sharded(mlp) == (
        ("gate_proj", "ColumnParallelLinear"),
        ("up_proj", "ColumnParallelLinear"),
    )


def test_a_config_no_causal_lm_builds_from_is_refused(monkeypatch):
    def build(*args, **kwargs):
        raise ValueError("no such layer\nmore detail")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", build)
    with pytest.raises(HfrewriteError) as e:
        plan_of("llama")
    assert str(e.value) == "llama: cannot build a causal LM from the config: ValueError: no such layer"


def test_a_model_that_does_not_run_is_refused(monkeypatch):
    from transformers.models.llama import modeling_llama

    def forward(self, *args, **kwargs):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(modeling_llama.LlamaModel, "forward", forward)
    with pytest.raises(HfrewriteError) as e:
        plan_of("llama")
    assert str(e.value) == "llama: LlamaForCausalLM: example run: RuntimeError: no kernel"


class HandAttention(nn.Module):
    """q/k/v/o attention through the attention interface: the base the cases below edit."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(32, 64, bias=False)
        self.k_proj = nn.Linear(32, 64, bias=False)
        self.v_proj = nn.Linear(32, 64, bias=False)
        self.o_proj = nn.Linear(64, 32, bias=False)

    def forward(self, x, pos):  # pos: a per-position tensor the base leaves unread
        batch, seq, _ = x.shape
        q, k, v = (
            p(x).view(batch, seq, -1, 16).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out, _ = opaque_attention(self, q, k, v, None, scaling=0.25)
        return self.o_proj(out.reshape(batch, seq, -1))


TINY_CONFIG = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16)


def attention_of(module, *extra):
    return analyze_attention(trace(module, (torch.randn(2, 3, 32), *extra)), "", TINY_CONFIG)


def hand_attention():
    return attention_of(HandAttention(), torch.randn(3, 16))


def test_hand_attention_matches():
    plan = hand_attention()
    assert (plan.num_heads, plan.num_kv_heads, plan.head_dim) == (4, 4, 16)
    assert (plan.q_norm, plan.rope_layers, plan.scaling, plan.sliding_window) == (
        None,
        RopeLayers.NONE,
        0.25,
        None,
    )


# One change to HandAttention each: (method, (old, new)), and the reason it is refused with.
ATTENTION_REFUSALS = {
    "k narrower than v": (
        "__init__",
        ("self.k_proj = nn.Linear(32, 64", "self.k_proj = nn.Linear(32, 32"),
        "fuse_qkv: k_proj and v_proj differ in out_features (32 != 64)",
    ),
    "a bias on q only": (
        "__init__",
        (
            "self.q_proj = nn.Linear(32, 64, bias=False)",
            "self.q_proj = nn.Linear(32, 64, bias=True)",
        ),
        "fuse_qkv: q_proj, k_proj and v_proj differ in bias",
    ),
    "softmax written out": (
        "forward",
        (
            "out, _ = opaque_attention(self, q, k, v, None, scaling=0.25)",
            "out = (torch.softmax(q @ k.transpose(2, 3) * 0.25, -1) @ v).transpose(1, 2)",
        ),
        (  # bidirectional, scaled by 0.25: not what the causal leaf computes
            "vllm_attention: computes a softmax attention by hand that is not proven causal "
            "self-attention at the default scale (torch's causal SDPA of its q, k and v does not reproduce it)"
        ),
    ),
    "a position transform that is not rope": (
        "forward",
        (
            "k = k.repeat_interleave",
            "q, k = q * pos, k * pos\n        k = k.repeat_interleave",
        ),
        (
            "vllm_attention: rotary embedding: the replay matches no rope vLLM computes from "
            "rope_parameters (neox or GPT-J style, either direction, over rotary dim 16 of 16)"
        ),
    ),
    "an s_aux tensor passed": (
        "forward",
        ("scaling=0.25)", "scaling=0.25, s_aux=torch.zeros(4))"),
        "vllm_attention: the attention sinks (s_aux) are not one per-head parameter of the attention",
    ),
    "a sink_scale passed": (
        "forward",
        ("scaling=0.25)", "scaling=0.25, sink_scale=0)"),
        "vllm_attention: the attention call passes sink_scale=0",
    ),
    "heads left unsplit": (
        "forward",
        ("p(x).view(batch, seq, -1, 16).transpose(1, 2)", "p(x)"),
        "vllm_attention: q, k and v are not [batch, heads, seq, head_dim]",
    ),
    "projections of flattened tokens": (  # not the [batch, seq, features] split vLLM assumes
        "forward",
        (
            "batch, seq, _ = x.shape",
            "batch, seq, _ = x.shape\n        x = x.flatten(0, 1)",
        ),
        "vllm_attention: the q projection's output is not [batch, seq, features]",
    ),
}


@pytest.mark.parametrize("case", list(ATTENTION_REFUSALS))
def test_attention_no_match_reasons(mutate, case):
    method, edit, reason = ATTENTION_REFUSALS[case]
    mutate(HandAttention, method, edit)
    assert str(hand_attention()) == f"HandAttention: {reason}"


def test_attention_without_scaling_takes_the_default(mutate):
    # no scaling passed: the interface's default, head_dim ** -0.5
    mutate(HandAttention, "forward", (", scaling=0.25)", ")"))
    assert hand_attention().scaling == 16**-0.5


class ActMlp(nn.Module):
    """`down(act(gate(x)) * up(x))` with the given activation object (silu by default):
    the base the MLP cases edit."""

    def __init__(self, act=None):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            nn.Linear(8, 16),
            nn.Linear(8, 16),
            nn.Linear(16, 8),
        )
        self.act_fn = act if act is not None else transformers.activations.ACT2FN["silu"]

    def forward(self, x):
        up = self.up_proj(x)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * up)


def mlp_of(module):
    return analyze_mlp(trace(module, (torch.randn(2, 8),)), "", TINY_CONFIG)


# one change to ActMlp.forward each: lane i of act(gate) * up still reads gate and up lane i
# alone, so the source's code stays between column-sharded projections
MLP_PAIRWISE = {
    "a function vLLM fuses no *AndMul for": (
        "self.act_fn(self.gate_proj(x))",
        "torch.tanh(self.gate_proj(x))",
    ),
    "torch's relu (no ReluAndMul)": (
        "self.act_fn(self.gate_proj(x))",
        "nn.functional.relu(self.gate_proj(x))",
    ),
    "a sum of gate and up": (") * up)", ") + up)"),
}


@pytest.mark.parametrize("case", list(MLP_PAIRWISE))
def test_a_lanewise_gate_and_up_keep_the_source_act(mutate, case):
    mutate(ActMlp, "forward", MLP_PAIRWISE[case])
    mlp = mlp_of(ActMlp())
    assert mlp.form is MlpForm.PAIRWISE and {mlp.gate.attr, mlp.up.attr} == {"gate_proj", "up_proj"}


MLP_REFUSALS = {  # lanes of gate and up mixed: no rank computes its columns alone
    "up flipped": ((") * up)", ") * up.flip(-1))"), "the product is not act(linear(x)) * linear(x)"),
    "up's mean": (
        (") * up)", ") * up.mean(-1, keepdim=True))"),
        "the product is not act(linear(x)) * linear(x)",
    ),
    "a sum of products": (
        (") * up)", ") * up + up.sum(-1, keepdim=True))"),
        "down_proj does not read a product of two",
    ),
}


@pytest.mark.parametrize("case", list(MLP_REFUSALS))
def test_mlp_no_match_reasons(mutate, case):
    edit, reason = MLP_REFUSALS[case]
    mutate(ActMlp, "forward", edit)
    assert mlp_of(ActMlp()) == NoMatch("fuse_gate_up", "ActMlp", reason)


@pytest.mark.parametrize(
    ("call", "activation"),
    [
        ("nn.functional.silu(self.gate_proj(x))", "silu"),
        ("nn.functional.gelu(self.gate_proj(x))", "gelu"),
        ("nn.functional.gelu(self.gate_proj(x), approximate='tanh')", "gelu_pytorch_tanh"),
    ],
)
def test_torch_activation_functions_called_inline_are_fused(mutate, call, activation):
    # custom code calls torch's function: no attribute holds it (act_attr ""), the name is vLLM's
    mutate(ActMlp, "forward", ("self.act_fn(self.gate_proj(x))", call))
    plan = mlp_of(ActMlp())
    assert (plan.act_attr, plan.activation) == ("", activation)


def test_activation_is_replayed_not_taken_from_its_class():
    # an activation object of the config's class that computes something else
    act = transformers.activations.ACT2FN["silu"]
    act.forward = lambda x: torch.nn.functional.silu(x) + 1.0
    result = mlp_of(ActMlp(act))
    # not vLLM's SiluAndMul: the source's act_fn stays, each rank on its columns
    assert (result.form, result.activation) == (MlpForm.PAIRWISE, "the source's own activation")
    assert mlp_of(ActMlp(transformers.activations.ACT2FN["silu"])).activation == "silu"


class FusedMlp(nn.Module):
    """`down(act(gate) * up)`, gate and up the halves of one projection (phi3's
    ``gate_up_proj``): the base the fused cases edit."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj, self.down_proj = (
            nn.Linear(8, 32, bias=False),
            nn.Linear(16, 8, bias=False),
        )
        self.act_fn = transformers.activations.ACT2FN["silu"]

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def test_fused_projection_halves_are_gate_and_up():
    plan = mlp_of(FusedMlp())
    assert (plan.fused_gate_up, plan.gate.attr, plan.gate.out_features) == (
        True,
        "gate_up_proj",
        16,
    ), plan


class SwigluClosureMlp(nn.Module):
    """ChatGLM3's MLP: one projection to twice the width, then a closure built in __init__
    that chunks it and multiplies torch's silu of one half by the other."""

    def __init__(self):
        super().__init__()
        self.dense_h_to_4h, self.dense_4h_to_h = (
            nn.Linear(8, 16 * 2, bias=False),
            nn.Linear(16, 8, bias=False),
        )

        def swiglu(x):
            x = torch.chunk(x, 2, dim=-1)
            return nn.functional.silu(x[0]) * x[1]

        self.activation_func = swiglu

    def forward(self, x):
        return self.dense_4h_to_h(self.activation_func(self.dense_h_to_4h(x)))


def test_torchs_activation_function_on_one_half_times_the_other_is_fused_gate_up():
    plan = mlp_of(SwigluClosureMlp())
    assert (plan.fused_gate_up, plan.gate.attr, plan.gate.out_features) == (True, "dense_h_to_4h", 16), plan
    assert (plan.act_attr, plan.activation) == ("", "silu")


@pytest.mark.parametrize(
    "edit",
    [
        ("* up)", "* gate)"),  # the gate half twice: no up half, not gate * up
        # clamped before the activation: the traced values equal the plain half, the computation does not
        ("self.act_fn(gate)", "self.act_fn(gate.clamp(-1e4, 1e4))"),
    ],
)
def test_fused_projection_halves_that_are_not_gate_and_up(mutate, edit):
    # no *AndMul computes them; lane i still reads lane i of each half alone: the source's
    # code stays, on the rank's [gate; up] columns of a MergedColumnParallelLinear
    mutate(FusedMlp, "forward", edit)
    mlp = mlp_of(FusedMlp())
    assert (mlp.form, mlp.fused_gate_up, mlp.gate.out_features) == (MlpForm.PAIRWISE, True, 16)
    assert mlp.form.column_sharded(mlp) == (("gate_up_proj", "MergedColumnParallelLinear"),)


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (("* up)", "* up.flip(-1))"), "the activation written out is not elementwise"),
        (("* up)", "* up.roll(1, -1))"), "the activation written out is not elementwise"),
    ],
)
def test_fused_projection_halves_read_across_lanes_are_refused(mutate, edit, reason):
    mutate(FusedMlp, "forward", edit)
    assert mlp_of(FusedMlp()) == NoMatch("fuse_gate_up", "FusedMlp", reason)


class GemmaStyleRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(dim)), eps

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return out * (1.0 + self.weight.float())


def test_norm_facts():
    assert analyze_norm(GemmaStyleRMSNorm(8)) == NormPlan("GemmaStyleRMSNorm", NormKind.GEMMA_RMS, 1e-5)
    refused = analyze_norm(nn.LayerNorm(8))
    assert isinstance(refused, NoMatch) and refused.pattern == "rms_norm"


class ConfigNorm(nn.Module):
    """ERNIE-4.5's RMSNorm, built from the config alone."""

    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(config.hidden_size))
        self.eps = config.rms_norm_eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def test_a_norm_built_from_the_config_names_its_fields_by_value():
    config = transformers.PretrainedConfig(hidden_size=8, rms_norm_eps=1e-5, intermediate_size=16)
    norm = ConfigNorm(config)
    assert config_fields(norm, analyze_norm(norm).eps, config) == ("hidden_size", "rms_norm_eps")
    config.head_dim = 8  # a second field of the norm's size: which one is not known
    assert "no one config field holds its size" in config_fields(norm, 1e-5, config)
    sized = transformers.models.llama.modeling_llama.LlamaRMSNorm(8)  # takes its sizes
    assert config_fields(sized, 1e-6, config) is None


class ResidualLayer(nn.Module):
    """`x + mlp(norm(x))`: one pre-norm residual block, the base the layer cases edit."""

    def __init__(self):
        super().__init__()
        self.mlp, self.norm = (
            nn.Sequential(nn.Linear(8, 8)),
            transformers.models.llama.modeling_llama.LlamaRMSNorm(8),
        )

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def decoder_of(module):
    return analyze_decoder(trace(module, (torch.randn(2, 8),)))


@pytest.mark.parametrize(
    "edits",
    [
        (),  # as it is
        (("x + self.mlp(self.norm(x))", "self.mlp(self.norm(x)) + x"),),  # the residual second
        (("self.norm(x)", "self.norm(x.to(torch.float32))"),),  # the norm reads the residual through a cast
    ],
)
def test_residual_blocks_in_either_operand_order_and_through_a_cast(mutate, edits):
    mutate(ResidualLayer, "forward", *edits)
    result = decoder_of(ResidualLayer())
    assert result.blocks == (ResidualBlock("norm", "mlp"),), result


class AddModule(nn.Module):
    """ERNIE-4.5's FusedDropoutImpl: ``dropout(x) + y``, the block's output first."""

    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.0)

    def forward(self, x, y):
        return self.dropout(x) + y


class TwoBlocksAddedInModules(nn.Module):
    def __init__(self):
        super().__init__()
        rms = transformers.models.llama.modeling_llama.LlamaRMSNorm
        self.norm1, self.attn, self.add1 = rms(8), nn.Sequential(nn.Linear(8, 8)), AddModule()
        self.norm2, self.mlp, self.add2 = rms(8), nn.Sequential(nn.Linear(8, 8)), AddModule()

    def forward(self, x):
        x = self.add1(self.attn(self.norm1(x)), x)
        return self.add2(self.mlp(self.norm2(x)), x)


def test_residual_adds_inside_a_module_are_found_in_either_order():
    result = decoder_of(TwoBlocksAddedInModules().eval())
    assert result.blocks == (ResidualBlock("norm1", "attn"), ResidualBlock("norm2", "mlp")), result


class BlockWithWeights(nn.Module):
    """An attention-like block handing back weights beside its output."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        out = self.proj(x)
        return out, out.softmax(-1)


class ReturnsMoreThanItsStream(nn.Module):
    """Bamba's layer: ``(hidden_states, attention weights or None)``."""

    def __init__(self, extra: str):
        super().__init__()
        rms = transformers.models.llama.modeling_llama.LlamaRMSNorm
        self.norm1, self.attn, self.norm2, self.mlp = rms(8), BlockWithWeights(), rms(8), nn.Linear(8, 8)
        self.extra = extra

    def forward(self, x):
        out, weights = self.attn(self.norm1(x))
        x = x + out
        x = x + self.mlp(self.norm2(x))
        extra = {"none": None, "weights": weights, "layer's own": x * 2}[self.extra]
        return x, extra


@pytest.mark.parametrize("extra", ["none", "weights"])
def test_a_layer_returning_its_stream_beside_attention_weights_or_nothing_is_fused(extra):
    result = decoder_of(ReturnsMoreThanItsStream(extra))
    assert result.blocks == (ResidualBlock("norm1", "attn"), ResidualBlock("norm2", "mlp")), result


def test_a_layer_returning_what_it_computes_itself_beside_its_stream_is_not_fused():
    result = decoder_of(ReturnsMoreThanItsStream("layer's own"))
    assert isinstance(result, NoMatch) and "does not return one hidden-states tensor" in result.reason


def test_decoder_post_norm_is_no_match(mutate):
    mutate(
        ResidualLayer,
        "forward",
        ("x + self.mlp(self.norm(x))", "self.norm(x + self.mlp(x))"),
    )
    result = decoder_of(ResidualLayer())
    assert isinstance(result, NoMatch) and result.pattern == "fused_residual_norm", result


class SplitKvAttention(nn.Module):
    """q from its own projection, k and v sliced from one fused kv projection."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.kv_proj = (
            nn.Linear(32, 64, bias=False),
            nn.Linear(32, 128, bias=False),
        )
        self.o_proj = nn.Linear(64, 32, bias=False)

    def forward(self, x):
        batch, seq, _ = x.shape
        kv = self.kv_proj(x)
        q, k, v = (
            t.view(batch, seq, -1, 16).transpose(1, 2) for t in (self.q_proj(x), kv[..., :64], kv[..., 64:])
        )
        out, _ = opaque_attention(self, q, k, v, None, scaling=0.25)
        return self.o_proj(out.reshape(batch, seq, -1))


def test_q_beside_a_fused_kv_projection_is_proven_with_its_row_layout():
    plan = attention_of(SplitKvAttention())
    assert not isinstance(plan, NoMatch), plan.reason
    assert plan.qkv_layout is QkvLayout.KV_BLOCKS
    assert (plan.q.attr, plan.q.out_features) == ("q_proj", 64)
    assert plan.k == plan.v and (plan.k.attr, plan.k.out_features) == ("kv_proj", 64)


@pytest.mark.parametrize("types", [["full_attention"] * 6, ["sliding_attention", "full_attention"] * 3])
def test_shrunk_config_has_one_layer_type_per_layer(types):
    from hfrewrite.analyze.shrink import shrink_config

    config = transformers.AutoConfig.for_model("qwen2", num_hidden_layers=6, layer_types=types)
    small = shrink_config(config)
    assert len(small.layer_types) == small.num_hidden_layers


def test_shrunk_moe_config_keeps_one_layer_of_each_mlp_kind_and_groups_of_experts():
    """exaone_moe: mlp_layer_types cut with the layers (its config validates the two agree),
    a dense then a sparse layer; the experts, counted by num_experts, fill 4 groups."""
    from hfrewrite.analyze.shrink import shrink_config

    small = shrink_config(transformers.AutoConfig.for_model("exaone_moe"))
    assert small.mlp_layer_types == ["dense", "sparse"] == small.mlp_layer_types[: small.num_hidden_layers]
    assert len(small.layer_types) == small.num_hidden_layers
    assert small.num_experts % small.n_group == 0 and small.num_experts // small.n_group >= 2
    small.validate_layer_type()


def test_layer_kinds_computed_from_attention_indices_are_shrunk_through_the_indices():
    """Bamba computes ``layer_types`` (a read-only property behind its attribute map) from
    ``attn_layer_indices``: that list is found by its values and cut with the layers, and the
    Mamba-2 heads times their width stay the expanded width; one more layer for validation
    keeps two attention layers."""
    from hfrewrite.analyze.shrink import shrink_config
    from hfrewrite.verify.validate import validation_config

    config = transformers.AutoConfig.for_model("bamba", num_hidden_layers=32, attn_layer_indices=[9, 18, 27])
    small = shrink_config(config)
    assert small.layer_types == ["linear_attention", "full_attention"] and small.attn_layer_indices == [1]
    assert small.mamba_n_heads * small.mamba_d_head == small.mamba_expand * small.hidden_size
    small.validate_architecture()
    assert validation_config(config).layer_types == ["linear_attention", "full_attention", "full_attention"]


def test_a_layer_unlike_the_first_is_named(monkeypatch):
    from transformers.models.llama import modeling_llama

    init = modeling_llama.LlamaAttention.__init__

    def biased_second_layer(self, config, layer_idx):
        init(self, config, layer_idx)
        if layer_idx == 1:
            self.o_proj = nn.Linear(self.o_proj.in_features, self.o_proj.out_features, bias=True)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "__init__", biased_second_layer)
    with pytest.raises(HfrewriteError, match=r"uniform_layers: layer 1 differs"):
        plan_of("llama")


class WeightRenaming:  # the shape of transformers' conversion rule the renames read
    def __init__(self, source, target):
        self.source_patterns, self.target_patterns = [source], [target]


def test_only_literal_prefix_renames_are_taken(monkeypatch):
    from hfrewrite.analyze import checkpoint

    rules = [
        WeightRenaming("^embed_out.", "lm_head."),
        WeightRenaming("^gpt_neox.", "model.(x)"),
        WeightRenaming("^a.", "b.|c."),
    ]
    monkeypatch.setattr(checkpoint, "get_checkpoint_conversion_mapping", lambda key: rules)
    assert checkpoint.checkpoint_prefix_renames("any") == (("embed_out.", "lm_head."),)
