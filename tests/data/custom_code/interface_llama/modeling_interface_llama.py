"""`interface_llama`: an in-house Llama variant written as Hub custom code for transformers 5 (hfrewrite tests).

Llama's math under its own class and attribute names (`query_proj`, `feed_forward.gate`, `stack`...), with its
own rotary-embedding module and RMSNorm, dispatching attention through transformers' attention interface
(`ALL_ATTENTION_FUNCTIONS`) with an eager fallback, and masks from `create_causal_mask`.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_interface_llama import InterfaceLlamaConfig


class InterfaceRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, hidden):
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hidden.to(dtype)


class InterfaceRotary(nn.Module):
    """cos/sin tables from the positions; the frequencies are computed on the fly (a non-persistent
    buffer made in __init__ is left uninitialised by transformers 5's from_pretrained)."""

    def __init__(self, config):
        super().__init__()
        self.theta = config.rope_parameters["rope_theta"]
        self.dim = config.head_dim

    @torch.no_grad()
    def forward(self, x, position_ids):
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64, device=x.device).float() / self.dim
        inv_freq = 1.0 / (self.theta**exponents)
        freqs = position_ids[:, :, None].float() * inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def swap_halves(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotate(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + swap_halves(q) * sin, k * cos + swap_halves(k) * sin


def eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value)
    return out.transpose(1, 2).contiguous(), probs


class InterfaceAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.attention_dropout = config.attention_dropout
        self.query_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=False
        )
        self.key_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.value_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False
        )
        self.out_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.query_proj(hidden_states).view(shape).transpose(1, 2)
        key = self.key_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.value_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = rotate(query, key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention
        )
        out, _ = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()
        return self.out_proj(out)


class InterfaceFeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class InterfaceBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.pre_attn_norm = InterfaceRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = InterfaceAttention(config, layer_idx)
        self.pre_mlp_norm = InterfaceRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = InterfaceFeedForward(config)

    def forward(
        self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None, **kwargs
    ):
        residual = hidden_states
        hidden_states = self.pre_attn_norm(hidden_states)
        hidden_states = self.attention(
            hidden_states, position_embeddings, attention_mask, past_key_values=past_key_values, **kwargs
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.feed_forward(self.pre_mlp_norm(hidden_states))
        return residual + hidden_states


class InterfaceLlamaPreTrainedModel(PreTrainedModel):
    config_class = InterfaceLlamaConfig
    base_model_prefix = "backbone"
    _supports_sdpa = True
    _supports_attention_backend = True


class InterfaceLlamaModel(InterfaceLlamaPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.stack = nn.ModuleList([InterfaceBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm_out = InterfaceRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = InterfaceRotary(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values: Cache | None = None,
        inputs_embeds=None,
        use_cache=None,
        **kwargs,
    ):
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if position_ids is None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past
            position_ids = position_ids.unsqueeze(0)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary(hidden_states, position_ids)
        for block in self.stack:
            hidden_states = block(
                hidden_states,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                past_key_values=past_key_values,
                **kwargs,
            )
        return BaseModelOutputWithPast(
            last_hidden_state=self.norm_out(hidden_states), past_key_values=past_key_values
        )


class InterfaceLlamaForCausalLM(InterfaceLlamaPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.backbone = InterfaceLlamaModel(config)
        self.lm_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.backbone.embed

    def set_input_embeddings(self, value):
        self.backbone.embed = value

    def get_output_embeddings(self):
        return self.lm_out

    def set_output_embeddings(self, value):
        self.lm_out = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values: Cache | None = None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_out(hidden[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)
