"""vLLM-side code for Mamba-1 blocks (selective scans): vLLM's ``MambaMixer``, runnable on
vLLM's CPU build too.

Parsed with libcst by ``passes/hybrid_mixer.py``, never imported at run time.
"""

from itertools import pairwise

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.mamba_mixer import (
    MambaMixer,
    split_batch_to_prefill_and_decode,
)
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    causal_conv1d_fn,
    causal_conv1d_update,
)
from vllm.platforms import current_platform


class TorchScanMambaMixer(MambaMixer):
    """vLLM's Mamba-1 mixer. vLLM's CPU build has no selective-scan kernel for prefills
    (``selective_scan_fwd``), its CPU state-update kernel is Mamba-2's (one decay per
    head, where Mamba-1 has one per channel and state), and its CPU GEMMs need
    contiguous rows: there the scan runs in torch in float32 after vLLM's causal
    convolution kernels (token by token within a prefill, all decoding sequences in
    one step), and the output projection reads a contiguous copy. On every other
    platform this is vLLM's mixer as it is."""

    def forward_impl(self, hidden_states: torch.Tensor, output: torch.Tensor) -> None:
        if not current_platform.is_cpu():
            super().forward_impl(hidden_states, output)
            return
        metadata = get_forward_context().attn_metadata
        metadata = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        projected = self.in_proj(hidden_states)[0].transpose(-2, -1)
        hidden_states_BC, gate = projected.chunk(2, dim=-2)
        if metadata is None:  # the profile run
            self.out_proj(hidden_states_BC.transpose(-2, -1).contiguous())
            return
        conv_state = self.kv_cache[0]
        if not is_conv_state_dim_first():
            conv_state = conv_state.transpose(-1, -2)
        conv_weights = self.conv1d.weight.view(
            self.conv1d.weight.size(0), self.conv1d.weight.size(2)
        )
        decodes, prefills = metadata.num_decode_tokens, metadata.num_prefill_tokens
        if decodes != metadata.num_decodes:  # speculative tokens: several per sequence
            raise NotImplementedError(
                "hfrewrite: TorchScanMambaMixer steps one token per decoding sequence on CPU"
            )
        split = split_batch_to_prefill_and_decode(
            hidden_states_BC, gate, prefills, decodes
        )
        outputs = []
        if decodes > 0:  # decode tokens come first, one per sequence
            conv_out = causal_conv1d_update(
                split.hidden_states_BC_d.transpose(0, 1),
                conv_state,
                conv_weights,
                self.conv1d.bias,
                self.activation,
                conv_state_indices=metadata.state_indices_tensor_d,
            )
            slots = metadata.state_indices_tensor_d[:, 0].long()
            outputs.append(self.step(conv_out, split.gate_d.transpose(0, 1), slots))
        if prefills > 0:
            conv_out = causal_conv1d_fn(
                split.hidden_states_BC_p,
                conv_weights,
                self.conv1d.bias,
                activation=self.activation,
                conv_states=conv_state,
                has_initial_state=metadata.has_initial_states_p,
                cache_indices=metadata.state_indices_tensor_p,
                query_start_loc=metadata.query_start_loc_p,
                metadata=metadata,
            ).transpose(-2, -1)
            outputs.append(
                self.scan(
                    conv_out,
                    split.gate_p.transpose(-2, -1),
                    metadata.query_start_loc_p.tolist(),
                    metadata.state_indices_tensor_p.tolist(),
                    metadata.has_initial_states_p.tolist(),
                )
            )
        scanned = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        output[: decodes + prefills] = self.out_proj(scanned.contiguous())[0]

    def scan(
        self,
        x: torch.Tensor,
        gate: torch.Tensor,
        starts: list[int],
        slots: list[int],
        resumed: list[bool],
    ) -> torch.Tensor:
        """The selective scan of each prefill sequence of ``x`` [tokens, channels] (the
        tokens of sequence i are ``starts[i]:starts[i + 1]``, its state
        ``ssm_state[slots[i]]``), from its cached state where ``resumed`` says it has
        one, token by token, writing its last state back."""
        ssm_state = self.kv_cache[1]
        dt, B, C, x = self.scan_inputs(x)
        out = torch.empty_like(gate)
        for seq, (start, end) in enumerate(pairwise(starts)):
            state = ssm_state[slots[seq]].float()[None]
            if not resumed[seq]:
                state = torch.zeros_like(state)
            for i in range(start, end):
                token = slice(i, i + 1)
                state = self.advance(state, dt[token], x[token], B[token])
                out[token] = self.gated(state, C[token], x[token], gate[token]).to(
                    out.dtype
                )
            ssm_state[slots[seq]] = state[0].to(ssm_state.dtype)
        return out

    def step(
        self, x: torch.Tensor, gate: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """One token of each decoding sequence (``x`` [sequences, channels], the states
        ``ssm_state[slots]``), all sequences at once, writing their states back."""
        ssm_state = self.kv_cache[1]
        dt, B, C, x = self.scan_inputs(x)
        state = self.advance(ssm_state[slots].float(), dt, x, B)
        ssm_state[slots] = state.to(ssm_state.dtype)
        return self.gated(state, C, x, gate).to(gate.dtype)

    def scan_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The time steps (after their bias and softplus), B, C and ``x`` of each token
        of ``x`` [tokens, channels], in float32."""
        time_step, B, C = self._ssm_transform(x.contiguous())
        bias = self._time_proj_bias()
        dt = time_step.transpose(-2, -1).float()
        dt = torch.nn.functional.softplus(dt if bias is None else dt + bias)
        return dt, B.float(), C.float(), x.float()

    def advance(
        self, state: torch.Tensor, dt: torch.Tensor, x: torch.Tensor, B: torch.Tensor
    ) -> torch.Tensor:
        """``s = exp(dt A) s + dt B x`` for states [n, channels, state], one token each."""
        return (
            torch.exp(dt[..., None] * self.A) * state
            + (dt * x)[..., None] * B[:, None, :]
        )

    def gated(
        self, state: torch.Tensor, C: torch.Tensor, x: torch.Tensor, gate: torch.Tensor
    ) -> torch.Tensor:
        """``(C s + D x) * silu(gate)``, one token of each state."""
        y = (state @ C[..., None]).squeeze(-1) + self.D.float() * x
        return y * torch.nn.functional.silu(gate.float())
