"""`fusedqkv_postnorm`: a causal LM written as Hub custom code, in plain PyTorch (hfrewrite tests).

What it exercises: one checkpoint-fused `Wqkv` Linear (with bias) whose output is split into q, k, v of unequal
sizes (GQA: 4 query heads, 2 kv heads); post-norms (LayerNorm applied to the attention and MLP outputs, before
each residual add, and no pre-norm); a GELU MLP with biases; rotate_half rope. No padding support:
`attention_mask` is accepted and ignored.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_fusedqkv_postnorm import FusedQKVPostNormConfig


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, positions, theta):
    """x: [b, heads, t, d]; positions: [b, t] integer positions."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device).float() / d))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return x * emb.cos().to(x.dtype) + rotate_half(x) * emb.sin().to(x.dtype)


class FusedAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv_heads * self.head_dim
        self.Wqkv = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=True)
        self.out_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x, positions, cache=None):
        b, t, _ = x.shape
        q, k, v = self.Wqkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, positions, self.theta)
        k = apply_rope(k, positions, self.theta)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        s = k.shape[-2]
        rep = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        # The t queries are the newest positions s - t .. s - 1 (bottom-right aligned causal mask).
        mask = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(diagonal=s - t)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, self.q_size))


class GeluMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class PostNormLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = FusedAttention(config, layer_idx)
        self.post_attn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = GeluMLP(config)
        self.post_mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x, positions, cache=None):
        x = x + self.post_attn_norm(self.attn(x, positions, cache))
        return x + self.post_mlp_norm(self.mlp(x))


class FusedQKVPostNormPreTrainedModel(PreTrainedModel):
    config_class = FusedQKVPostNormConfig
    base_model_prefix = "backbone"


class FusedQKVPostNormModel(FusedQKVPostNormPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList([PostNormLayer(config, i) for i in range(config.num_hidden_layers)])
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, value):
        self.wte = value

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
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        cache = past_key_values if use_cache else None
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + inputs_embeds.shape[1], device=inputs_embeds.device)
            position_ids = position_ids[None].expand(inputs_embeds.shape[0], -1)
        x = inputs_embeds
        for layer in self.h:
            x = layer(x, position_ids, cache)
        return BaseModelOutputWithPast(last_hidden_state=self.ln_f(x), past_key_values=cache)


class FusedQKVPostNormForCausalLM(FusedQKVPostNormPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.backbone = FusedQKVPostNormModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.backbone.wte

    def set_input_embeddings(self, value):
        self.backbone.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

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
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)
