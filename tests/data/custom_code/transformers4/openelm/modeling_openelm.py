# Tiny test copy, in the style of Apple's OpenELM Hub `modeling_openelm.py` (transformers 4.39):
# layer-wise scaling (each layer its own head counts and MLP width), one fused qkv_proj per
# layer split per head, q/k RMS norms, a rotary module that slices a cos/sin cache by the key
# length, torch's SDPA called directly, and an lm_head that is the token embeddings themselves.
# Written for the hfrewrite tests; not the original file.

from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging

from .configuration_openelm import OpenELMConfig, make_divisible

logger = logging.get_logger(__name__)


class OpenELMRMSNorm(nn.Module):
    def __init__(self, num_features: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_features))
        self.num_features = num_features

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self._norm(x.float()).type_as(x)
        return output * self.weight

    def extra_repr(self) -> str:
        return f"num_features={self.num_features}, eps={self.eps}"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary_pos_emb(x: torch.Tensor, pos_sin: torch.Tensor, pos_cos: torch.Tensor) -> torch.Tensor:
    return (x * pos_cos) + (_rotate_half(x) * pos_sin)


class OpenELMRotaryEmbedding(nn.Module):
    """Rotary embedding whose cos/sin tables are cached up to the longest key length seen;
    positions are counted from the key length (no position ids)."""

    def __init__(self, model_dim: int, max_seq_length: int, freq_constant: int = 10000) -> None:
        super().__init__()
        inv_freq = 1.0 / (freq_constant ** (torch.arange(0, model_dim, 2, dtype=torch.float32) / model_dim))
        self.model_dim = model_dim
        self.freq_constant = freq_constant
        self.max_seq_length = max_seq_length
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cached_cos = None
        self._cached_sin = None
        self._cached_seq_length = max_seq_length
        self._compute_sin_cos_embeddings(max_seq_length)

    def extra_repr(self) -> str:
        return f"model_dim={self.model_dim}, max_seq_length={self.max_seq_length}, freq_constant={self.freq_constant}"

    def _compute_sin_cos_embeddings(self, key_len: int, key_device="cpu", key_dtype=torch.float32) -> None:
        if (
            key_len > self._cached_seq_length
            or self._cached_cos is None
            or self._cached_cos.device != key_device
            or self._cached_cos.dtype != key_dtype
        ):
            self._cached_seq_length = max(key_len, self._cached_seq_length)
            pos_index = torch.arange(self._cached_seq_length, dtype=torch.float32, device=self.inv_freq.device)
            pos_index_theta = torch.einsum("i,j->ij", pos_index, self.inv_freq)
            emb = torch.cat((pos_index_theta, pos_index_theta), dim=-1)
            self._cached_cos = emb.cos().to(dtype=key_dtype, device=key_device)[None, None, :, :]
            self._cached_sin = emb.sin().to(dtype=key_dtype, device=key_device)[None, None, :, :]

    def forward(self, query: torch.Tensor, key: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """query: [batch, q_heads, query_len, head_dim]; key: [batch, k_heads, key_len, head_dim]
        (the cached keys first, not yet rotated)."""
        dim = key.shape[-1]
        key_len = key.shape[2]
        query_len = query.shape[2]
        assert dim == self.model_dim
        assert key.device == query.device
        assert key.dtype == query.dtype

        # rotated in float32
        query_float = query.float()
        key_float = key.float()
        self._compute_sin_cos_embeddings(key_len, key_device=key_float.device, key_dtype=key_float.dtype)
        query_float = _apply_rotary_pos_emb(
            x=query_float,
            pos_sin=self._cached_sin[..., key_len - query_len : key_len, :],
            pos_cos=self._cached_cos[..., key_len - query_len : key_len, :],
        )
        key_float = _apply_rotary_pos_emb(
            x=key_float,
            pos_sin=self._cached_sin[..., :key_len, :],
            pos_cos=self._cached_cos[..., :key_len, :],
        )
        return query_float.type_as(query), key_float.type_as(key)


class OpenELMMultiHeadCausalAttention(nn.Module):
    def __init__(self, config: OpenELMConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        head_dim = config.head_dim
        q_heads = config.num_query_heads[layer_idx]
        k_heads = config.num_kv_heads[layer_idx]
        v_heads = config.num_kv_heads[layer_idx]

        self.qkv_proj = nn.Linear(config.model_dim, (q_heads + k_heads + v_heads) * head_dim, bias=False)
        self.pos_embedding = OpenELMRotaryEmbedding(
            model_dim=config.head_dim,
            max_seq_length=config.rope_max_length,
            freq_constant=config.rope_freq_constant,
        )
        if config.normalize_qk_projections:
            self.q_norm = OpenELMRMSNorm(num_features=config.head_dim)
            self.k_norm = OpenELMRMSNorm(num_features=config.head_dim)
        else:
            self.q_norm = None
            self.k_norm = None

        self.out_proj = nn.Linear(q_heads * head_dim, config.model_dim, bias=False)

        self.head_dim = config.head_dim
        self.num_q_heads = q_heads
        self.num_k_heads = k_heads
        self.num_v_heads = v_heads
        self.transformer_dim = config.model_dim
        self.num_groups = self.num_q_heads // self.num_k_heads

    def extra_repr(self) -> str:
        return (
            super().extra_repr()
            + f"query_heads={self.num_q_heads}, key_heads={self.num_k_heads}, value_heads={self.num_v_heads}"
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_value: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        output_attentions: bool = False,
        use_cache: bool = False,
    ):
        output_attentions = False  # SDPA returns no weights
        batch_size, seq_length, d_model = hidden_states.size()

        # [B, S, d] --> [B, S, (q_h + k_h + v_h) * h]
        qkv = self.qkv_proj(hidden_states)
        # [B, S, (q_h + k_h + v_h) * h] --> [B, S, (q_h + k_h + v_h), h]
        qkv = qkv.reshape(batch_size, seq_length, self.num_q_heads + self.num_k_heads + self.num_v_heads, self.head_dim)
        # [B, S, (q_h + k_h + v_h), h] --> [B, (q_h + k_h + v_h), S, h]
        qkv = qkv.transpose(1, 2)
        # [B, (q_h + k_h + v_h), S, h] --> [B, q_h, S, h], [B, k_h, S, h], [B, v_h, S, h]
        queries, keys, values = qkv.split([self.num_q_heads, self.num_k_heads, self.num_v_heads], dim=1)

        if self.q_norm is not None:
            queries = self.q_norm(queries)
        if self.k_norm is not None:
            keys = self.k_norm(keys)

        # the cache holds keys before the rope: all of them are rotated below
        if past_key_value is not None:
            keys = torch.cat([past_key_value[0], keys], dim=2)
            values = torch.cat([past_key_value[1], values], dim=2)
        present = (keys, values) if use_cache else None

        queries, keys = self.pos_embedding(queries, keys)

        if self.num_groups != 1:
            # GQA: [B, k_h, S, h] --> [B, q_h, S, h]
            keys = keys.repeat_interleave(self.num_groups, dim=1)
            values = values.repeat_interleave(self.num_groups, dim=1)

        attn_output = F.scaled_dot_product_attention(queries, keys, values, attn_mask=attention_mask, dropout_p=0)
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(batch_size, seq_length, self.num_q_heads * self.head_dim)
        attn_output = self.out_proj(attn_output)
        if not output_attentions:
            attn_weights = None
        return attn_output, attn_weights, present


class OpenELMFeedForwardNetwork(nn.Module):
    def __init__(self, config: OpenELMConfig, layer_idx: int) -> None:
        super().__init__()
        ffn_multiplier = config.ffn_multipliers[layer_idx]
        intermediate_dim = int(make_divisible(ffn_multiplier * config.model_dim, divisor=config.ffn_dim_divisor))
        if config.ffn_with_glu:
            # FFN with Gated linear unit, as described in https://arxiv.org/abs/2002.05202v1.
            self.proj_1 = nn.Linear(config.model_dim, 2 * intermediate_dim, bias=False)
            self.proj_2 = nn.Linear(intermediate_dim, config.model_dim, bias=False)
            self.ffn_with_glu = True
        else:
            self.proj_1 = nn.Linear(config.model_dim, intermediate_dim, bias=False)
            self.proj_2 = nn.Linear(intermediate_dim, config.model_dim, bias=False)
            self.ffn_with_glu = False
        self.act = ACT2FN[config.activation_fn_name]

    def extra_repr(self) -> str:
        return super().extra_repr() + f"(ffn_with_glu) : {self.ffn_with_glu}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ffn_with_glu:
            y_12 = self.proj_1(x)
            y_1, y_2 = y_12.chunk(2, dim=-1)
            y = self.act(y_1) * y_2
            return self.proj_2(y)
        return self.proj_2(self.act(self.proj_1(x)))


class OpenELMDecoderLayer(nn.Module):
    def __init__(self, config: OpenELMConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn = OpenELMMultiHeadCausalAttention(config=config, layer_idx=layer_idx)
        self.ffn = OpenELMFeedForwardNetwork(config=config, layer_idx=layer_idx)
        self.ffn_norm = OpenELMRMSNorm(num_features=config.model_dim)
        self.attn_norm = OpenELMRMSNorm(num_features=config.model_dim)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_value: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
        output_attentions: Optional[bool] = False,
        use_cache: Optional[bool] = False,
    ):
        residual = hidden_states
        hidden_states = self.attn_norm(hidden_states)

        # Self Attention
        hidden_states, self_attn_weights, present_key_value = self.attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            past_key_value=past_key_value,
            output_attentions=output_attentions,
            use_cache=use_cache,
        )
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.ffn_norm(hidden_states)
        hidden_states = self.ffn(hidden_states)
        hidden_states = residual + hidden_states

        outputs = (hidden_states,)
        if output_attentions:
            outputs += (self_attn_weights,)
        if use_cache:
            outputs += (present_key_value,)
        return outputs


class OpenELMPreTrainedModel(PreTrainedModel):
    config_class = OpenELMConfig
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = True
    _no_split_modules = ["OpenELMDecoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, OpenELMRMSNorm):
            module.weight.data.fill_(1.0)


class OpenELMModel(OpenELMPreTrainedModel):
    config_class = OpenELMConfig

    def __init__(self, config: OpenELMConfig):
        super().__init__(config)
        self.config = config

        self.token_embeddings = nn.Embedding(embedding_dim=config.model_dim, num_embeddings=config.vocab_size)
        self.layers = nn.ModuleList(
            OpenELMDecoderLayer(config=config, layer_idx=layer_idx)
            for layer_idx in range(config.num_transformer_layers)
        )
        self.norm = OpenELMRMSNorm(num_features=config.model_dim)
        if config.share_input_output_layers:
            self.classifier = None
        else:
            self.classifier = nn.Linear(config.model_dim, config.vocab_size, bias=False)
        self.num_transformer_layers = config.num_transformer_layers
        self.gradient_checkpointing = False

        self.post_init()

    def get_input_embeddings(self):
        return self.token_embeddings

    def set_input_embeddings(self, new_embeddings: torch.Tensor):
        self.token_embeddings = new_embeddings

    def _causal_mask(self, attention_mask, query_len: int, key_len: int, dtype: torch.dtype, device):
        """[batch, 1, query_len, key_len], 0 where a query may attend and the dtype's minimum
        elsewhere: the keys after its own position, and padding."""
        min_dtype = torch.finfo(dtype).min
        causal = torch.full((query_len, key_len), fill_value=min_dtype, dtype=dtype, device=device)
        causal = torch.triu(causal, diagonal=key_len - query_len + 1)
        causal = causal[None, None, :, :]
        if attention_mask is not None and attention_mask.dim() == 2:
            padding = attention_mask[:, None, None, :key_len].eq(0)
            causal = causal.masked_fill(padding, min_dtype)
        return causal

    def forward(
        self,
        input_ids: torch.LongTensor = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
    ) -> Union[Tuple, BaseModelOutputWithPast]:
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        return_dict = return_dict if return_dict is not None else self.config.use_return_dict

        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

        if inputs_embeds is None:
            inputs_embeds = self.token_embeddings(input_ids)

        past_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        query_len = inputs_embeds.shape[1]
        causal_mask = self._causal_mask(
            attention_mask, query_len, past_length + query_len, inputs_embeds.dtype, inputs_embeds.device
        )

        hidden_states = inputs_embeds
        all_hidden_states = () if output_hidden_states else None
        all_self_attns = () if output_attentions else None
        next_decoder_cache = () if use_cache else None

        for idx, decoder_layer in enumerate(self.layers):
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            layer_outputs = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                past_key_value=past_key_values[idx] if past_key_values is not None else None,
                output_attentions=output_attentions,
                use_cache=use_cache,
            )
            hidden_states = layer_outputs[0]
            if use_cache:
                next_decoder_cache += (layer_outputs[2 if output_attentions else 1],)
            if output_attentions:
                all_self_attns += (layer_outputs[1],)

        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)

        next_cache = next_decoder_cache if use_cache else None
        if not return_dict:
            return tuple(v for v in [hidden_states, next_cache, all_hidden_states, all_self_attns] if v is not None)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            past_key_values=next_cache,
            hidden_states=all_hidden_states,
            attentions=all_self_attns,
        )


class OpenELMForCausalLM(OpenELMPreTrainedModel, GenerationMixin):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config: OpenELMConfig):
        super().__init__(config)
        self.transformer = OpenELMModel(config)
        self.vocab_size = config.vocab_size
        if config.share_input_output_layers:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.model_dim, config.vocab_size, bias=False)

        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.token_embeddings

    def set_input_embeddings(self, value):
        self.transformer.token_embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        **kwargs,
    ) -> Union[Tuple, CausalLMOutputWithPast]:
        return_dict = return_dict if return_dict is not None else self.config.use_return_dict
        # with a cache only the last token is fed (callers may pass the whole sequence)
        if past_key_values is not None and input_ids is not None:
            input_ids = input_ids[:, -1:]

        outputs = self.transformer(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )

        hidden_states = outputs[0]
        if self.lm_head is None:
            # shared input and output embeddings
            logits = F.linear(hidden_states, weight=self.transformer.token_embeddings.weight)
        else:
            logits = self.lm_head(hidden_states)
        logits = logits[:, :, : self.config.vocab_size]
        logits = logits.float()

        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous().to(shift_logits.device)
            loss = nn.CrossEntropyLoss()(shift_logits.view(-1, self.config.vocab_size), shift_labels.view(-1))

        if not return_dict:
            output = (logits,) + outputs[1:]
            return (loss,) + output if loss is not None else output
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
