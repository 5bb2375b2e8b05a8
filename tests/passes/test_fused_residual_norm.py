"""fused_residual_norm: vLLM RMSNorm with the residual add fused in."""

import pytest
from harness import apply, rewrite
from hfrewrite.passes import fused_residual_norm
from plans import llama_like

from hfrewrite.errors import HfrewriteError

BEFORE_LLAMA_DECODER_LAYER = """\
class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps


class LlamaDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        # Self Attention
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states
"""

AFTER_LLAMA_DECODER_LAYER = """\
class LlamaDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Self Attention
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)

        # Fully Connected
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual
"""


def test_llama_decoder_layer():
    # the source norm class is replaced everywhere, so its definition goes
    assert (
        rewrite(fused_residual_norm, BEFORE_LLAMA_DECODER_LAYER, llama_like()).lstrip()
        == AFTER_LLAMA_DECODER_LAYER
    )


REFUSED_BLOCK_NOT_CALLED = """\
class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps


class LlamaDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        # Self Attention
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = hidden_states
        hidden_states = residual + hidden_states
        return hidden_states
"""


def test_refuses_block_not_called():
    with pytest.raises(HfrewriteError, match="self.mlp is not called"):
        rewrite(fused_residual_norm, REFUSED_BLOCK_NOT_CALLED, llama_like())


def test_sandwich_norms_stay_on_the_block_outputs():
    import dataclasses

    from hfrewrite.analyze.plan import ResidualBlock

    plan = llama_like()
    blocks = (
        ResidualBlock("input_layernorm", "self_attn", "post_attention_layernorm"),
        ResidualBlock("pre_feedforward_layernorm", "mlp", "post_feedforward_layernorm"),
    )
    plan = dataclasses.replace(plan, decoder_layer=dataclasses.replace(plan.decoder_layer, blocks=blocks))
    source = BEFORE_LLAMA_DECODER_LAYER.replace(
        "hidden_states = self.post_attention_layernorm(hidden_states)\n        hidden_states = self.mlp",
        "hidden_states = self.pre_feedforward_layernorm(hidden_states)\n        hidden_states = self.mlp",
    )
    out = rewrite(fused_residual_norm, source, plan)
    assert (
        "        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)\n"
        "        hidden_states = self.post_attention_layernorm(hidden_states)\n"
    ) in out
    assert (
        "        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)\n"
        "        hidden_states = self.mlp(hidden_states)\n"
        "        hidden_states = self.post_feedforward_layernorm(hidden_states)\n"
        "        return hidden_states, residual\n"
    ) in out


def test_reports_each_norm_built():
    result = apply(fused_residual_norm, BEFORE_LLAMA_DECODER_LAYER, llama_like())
    assert result.matches == 2  # input_layernorm and post_attention_layernorm
    assert result.fused[0].fused.endswith("(2 uses)")


def test_a_forward_docstring_moves_no_comment():
    # the docstring shifts every statement by one; each comment still leads its own block
    source = BEFORE_LLAMA_DECODER_LAYER.replace(
        "    def forward(self, hidden_states, attention_mask=None, **kwargs):\n",
        '    def forward(self, hidden_states, attention_mask=None, **kwargs):\n        """One decoder layer."""\n',
    )
    assert rewrite(fused_residual_norm, source, llama_like()).lstrip() == AFTER_LLAMA_DECODER_LAYER


def test_a_norm_built_from_the_config_gets_its_proven_fields():
    """ERNIE-4.5's ``Norm(config)``: vLLM's norm built from the fields the analysis found."""
    import dataclasses

    plan = llama_like()
    plan = dataclasses.replace(
        plan, norm=dataclasses.replace(plan.norm, config_fields=("hidden_size", "rms_norm_eps"))
    )
    source = BEFORE_LLAMA_DECODER_LAYER.replace(
        "def __init__(self, hidden_size, eps=1e-6):", "def __init__(self, config):"
    )
    source = source.replace(
        "LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)", "LlamaRMSNorm(config)"
    )
    assert rewrite(fused_residual_norm, source, plan).lstrip() == AFTER_LLAMA_DECODER_LAYER
    with pytest.raises(HfrewriteError, match="built from the config, called with other arguments"):
        rewrite(
            fused_residual_norm, source.replace("LlamaRMSNorm(config)", "LlamaRMSNorm(config, 2)", 1), plan
        )


def test_a_norm_class_chosen_by_a_config_test_and_torchs_factory_keywords():
    # ChatGLM3: `LayerNormFunc = RMSNorm if config.rmsnorm else LayerNorm`, its norm taking
    # torch's device and dtype: the traced class inlined, the other branch refused, the
    # factory keywords left to vLLM
    source = (
        BEFORE_LLAMA_DECODER_LAYER.replace(
            "def __init__(self, hidden_size, eps=1e-6):",
            "def __init__(self, hidden_size, eps=1e-6, device=None, dtype=None, **kwargs):",
        )
        .replace(
            "        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)\n",
            "        LayerNormFunc = LlamaRMSNorm if config.rmsnorm else LayerNorm\n"
            "        self.input_layernorm = LayerNormFunc(config.hidden_size, eps=config.rms_norm_eps, device=None)\n",
        )
        .replace(
            "self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)",
            "self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps, None, None)",
        )
    )
    out = rewrite(fused_residual_norm, source, llama_like())
    assert (
        "        if not (config.rmsnorm):\n"
        '            raise NotImplementedError("hfrewrite: converted for configs where `config.rmsnorm` is True: '
        'another norm class is built here")\n'
        "        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)\n"
        "        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)\n"
    ) in out, out
    assert "LayerNormFunc" not in out
