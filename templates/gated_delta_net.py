"""vLLM-side code for OLMo-hybrid's gated delta nets: vLLM's
``OlmoHybridGatedDeltaNetAttention``, runnable on vLLM's CPU build too.

Parsed with libcst by ``passes/hybrid_mixer.py``, never imported at run time.
"""

from unittest import mock

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn import olmo_gdn_linear_attn
from vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn import (
    OlmoHybridGatedDeltaNetAttention,
)
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    causal_conv1d_fn,
    causal_conv1d_update,
)
from vllm.platforms import current_platform


class TorchOlmoGatedDeltaNet(OlmoHybridGatedDeltaNetAttention):
    """vLLM's OLMo-hybrid gated delta net. vLLM's CPU build has none of the triton kernels
    it runs (its gating, its delta rule), nor the triton allocator its ``__init__`` sets:
    there the delta rule runs in torch in float32 after vLLM's causal convolution (token by
    token within a prefill, all decoding sequences in one step), on the states vLLM caches.
    On every other platform this is vLLM's layer as it is, its convolution's loader taking
    the shard id the weights mapper gives."""

    def __init__(self, config, vllm_config, prefix: str = "") -> None:
        if current_platform.is_cpu():
            with mock.patch.object(
                olmo_gdn_linear_attn, "set_triton_allocator", lambda device: None
            ):
                super().__init__(config, vllm_config, prefix=prefix)
        else:
            super().__init__(config, vllm_config, prefix=prefix)
        # vLLM's loader of the fused convolution takes its shard id as an argument, where
        # AutoWeightsLoader hands it over on the tensor (WeightsMapper's stacked names)
        load_shard = self.conv1d.weight.weight_loader
        self.conv1d.weight.weight_loader = lambda param, weight, shard_id=None: (
            load_shard(param, weight, weight.shard_id if shard_id is None else shard_id)
        )

    def _forward_core(
        self,
        mixed_qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        core_attn_out: torch.Tensor,
    ) -> None:
        if not current_platform.is_cpu():
            super()._forward_core(mixed_qkv, b, a, core_attn_out)
            return
        metadata = get_forward_context().attn_metadata
        metadata = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        if metadata is None:  # the profile run
            return
        if metadata.spec_sequence_masks is not None:
            raise NotImplementedError(
                "hfrewrite: TorchOlmoGatedDeltaNet steps one token per decoding sequence on CPU"
            )
        tokens, decodes = metadata.num_actual_tokens, metadata.num_decodes
        slots = metadata.non_spec_state_indices_tensor
        starts = metadata.non_spec_query_start_loc
        conv_state = self.kv_cache[0]
        if not is_conv_state_dim_first():
            conv_state = conv_state.transpose(-1, -2)
        weights = self.conv1d.weight.view(
            self.conv1d.weight.size(0), self.conv1d.weight.size(2)
        )
        mixed_qkv = mixed_qkv[:tokens]
        if metadata.num_prefills > 0:
            mixed_qkv = causal_conv1d_fn(
                mixed_qkv.transpose(0, 1),
                weights,
                None,
                activation=self.activation,
                conv_states=conv_state,
                has_initial_state=metadata.has_initial_state,
                cache_indices=slots,
                query_start_loc=starts,
                metadata=metadata,
            ).transpose(0, 1)
        else:
            mixed_qkv = causal_conv1d_update(
                mixed_qkv,
                conv_state,
                weights,
                None,
                self.activation,
                conv_state_indices=slots[:decodes],
            )
        q, k, v = (x[0].float() for x in self.rearrange_mixed_qkv(mixed_qkv))
        q = self.unit_length(q) * self.head_k_dim**-0.5
        k = self.unit_length(k)
        beta = b[:tokens].float().sigmoid() * (2.0 if self.allow_neg_eigval else 1.0)
        decay = torch.exp(
            -self.A_log.float().exp()
            * torch.nn.functional.softplus(a[:tokens].float() + self.dt_bias.float())
        )
        ssm_state = self.kv_cache[1]
        # [slots, heads, k_dim, v_dim]: the layout only this class reads and writes
        ssm_state = ssm_state.view(
            *ssm_state.shape[:2], self.head_k_dim, self.head_v_dim
        )
        out = torch.empty_like(v)
        if decodes > 0:  # decode tokens come first, one per sequence
            at = slots[:decodes].long()
            state, out[:decodes] = self.step(
                ssm_state[at].float(),
                q[:decodes],
                k[:decodes],
                v[:decodes],
                beta[:decodes],
                decay[:decodes],
            )
            ssm_state[at] = state.to(ssm_state.dtype)
        bounds = starts.tolist()
        resumed = (
            metadata.has_initial_state.tolist()
            if metadata.has_initial_state is not None
            else [True] * (len(bounds) - 1)
        )
        for seq in range(decodes, len(bounds) - 1):
            slot = int(slots[seq])
            state = ssm_state[slot].float()[None]
            if not resumed[seq]:
                state = torch.zeros_like(state)
            for i in range(bounds[seq], bounds[seq + 1]):
                token = slice(i, i + 1)
                state, out[token] = self.step(
                    state, q[token], k[token], v[token], beta[token], decay[token]
                )
            ssm_state[slot] = state[0].to(ssm_state.dtype)
        core_attn_out[:tokens] = out.to(core_attn_out.dtype)

    @staticmethod
    def unit_length(x: torch.Tensor) -> torch.Tensor:
        """Each head's vector over its L2 norm (epsilon 1e-6 inside, as vLLM's kernels)."""
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)

    @staticmethod
    def step(
        state: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        beta: torch.Tensor,
        decay: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of each state [n, heads, k_dim, v_dim]: ``S = decay S``, then
        ``S += k (beta (v - S^T k))^T``; returns the new states and ``S^T q``."""
        state = state * decay[..., None, None]
        delta = (v - (state * k[..., None]).sum(-2)) * beta[..., None]
        state = state + k[..., None] * delta[..., None, :]
        return state, (state * q[..., None]).sum(-2)
