"""vLLM-side code for MiniMax's lightning attention: vLLM's
``MiniMaxText01LinearAttention``, runnable on vLLM's CPU build too.

Parsed with libcst by ``passes/hybrid_mixer.py``, never imported at run time.
"""

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.linear.minimax_linear_attn import (
    MiniMaxText01LinearAttention,
)
from vllm.platforms import current_platform


class TorchMiniMaxLinearAttention(MiniMaxText01LinearAttention):
    """vLLM's lightning attention, its norm built with the source block's epsilon (vLLM's
    takes 1e-5, which parts from the source where the heads' outputs are small) and its
    decay rates loaded from the checkpoint where it holds them. vLLM's CPU build has no
    kernel for its recurrence (triton only): there it runs in torch in float32, token by
    token within a prefill, all decoding sequences in one step, on the states vLLM caches.
    On every other platform this is vLLM's layer as it is."""

    def __init__(
        self, config, vllm_config, prefix: str = "", norm_eps: float = 1e-5
    ) -> None:
        super().__init__(config, vllm_config, prefix=prefix)
        self.norm.variance_epsilon = norm_eps
        # each head's decay rate: vLLM's, or the checkpoint's own where it holds them (as
        # transformers runs them: it computes them with another epsilon)
        rates = self.slope_rate.clone()
        del self.slope_rate
        self.register_buffer("slope_rate", rates)
        self.slope_rate.weight_loader = self.load_rates

    def load_rates(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.view_as(param))
        heads = slice(self.tp_rank * self.tp_heads, (self.tp_rank + 1) * self.tp_heads)
        self.tp_slope = param.data[heads].contiguous()

    def _forward(
        self, hidden_states: torch.Tensor, output: torch.Tensor, positions: torch.Tensor
    ) -> None:
        if not current_platform.is_cpu():
            super()._forward(hidden_states, output, positions)
            return
        metadata = get_forward_context().attn_metadata
        metadata = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        tokens = hidden_states.shape[0]
        if metadata is not None:
            tokens = metadata.num_prefill_tokens + metadata.num_decode_tokens
        qkv, _ = self.qkv_proj(hidden_states[:tokens])
        qkv = torch.nn.functional.silu(qkv.float()).view(tokens, self.tp_heads, -1)
        q, k, v = qkv.split([self.head_dim] * 3, dim=-1)
        if metadata is None:  # the profile run
            mixed = torch.zeros_like(v)
        else:
            mixed = self.recurrence(q, k, v, metadata)
        mixed = self.norm._forward(mixed.reshape(tokens, -1))
        gate, _ = self.output_gate(hidden_states[:tokens])
        mixed = (torch.sigmoid(gate) * mixed).to(hidden_states.dtype)
        output[:tokens], _ = self.out_proj(mixed)

    def recurrence(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata
    ) -> torch.Tensor:
        """Each token's ``q S`` [tokens, heads, head_dim], the state of its sequence first
        decayed, ``S = exp(-slope) S + k^T v``; the states read from and written back to
        vLLM's cache (a sequence with no earlier tokens starts from zero)."""
        states = self.kv_cache[0]
        decay = torch.exp(-self.tp_slope.float()).view(-1, 1, 1)
        slots = metadata.state_indices_tensor
        out = torch.empty_like(v)
        decodes = metadata.num_decodes
        if decodes > 0:  # decode tokens come first, one per sequence
            at = slots[:decodes].long()
            state = (
                decay * states[at].float()
                + k[:decodes, ..., None] * v[:decodes, :, None]
            )
            out[:decodes] = (q[:decodes, ..., None] * state).sum(-2)
            states[at] = state.to(states.dtype)
        starts = metadata.query_start_loc.tolist()
        lengths = metadata.seq_lens.tolist()
        for seq in range(decodes, len(starts) - 1):
            slot, begin, end = int(slots[seq]), starts[seq], starts[seq + 1]
            state = states[slot].float()
            if lengths[seq] == end - begin:  # no earlier tokens
                state = torch.zeros_like(state)
            for i in range(begin, end):
                state = decay * state + k[i, :, :, None] * v[i, :, None, :]
                out[i] = (q[i, :, :, None] * state).sum(-2)
            states[slot] = state.to(states.dtype)
        return out
