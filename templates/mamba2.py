"""vLLM-side code for Mamba-2 blocks with muP factors (Falcon-H1's), a time-step floor
(NemotronH's) or a gated norm over all groups (transformers' Mamba-2's).

Parsed with libcst by ``passes/hybrid_mixer.py``, never imported at run time.
"""

import torch
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.mamba_mixer2 import (
    MambaMixer2,
    Mixer2RMSNormGated,
)


class ScaledMambaMixer2(MambaMixer2):
    """vLLM's Mamba-2 mixer on its input times ``input_scale``, the output of its input
    projection times ``projection_scale`` (if any), one factor per column of the source's
    ``[z, x, B, C, dt]`` projection, as the source's block computes."""

    def __init__(
        self, input_scale: float, projection_scale: torch.Tensor | None, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.input_scale = input_scale
        if projection_scale is not None:
            projection_scale = self.rank_columns(projection_scale.reshape(-1))
        self.register_buffer("projection_scale", projection_scale, persistent=False)

    def rank_columns(self, columns: torch.Tensor) -> torch.Tensor:
        """This rank's part of a vector over the projection's columns: z, x, B, C and dt
        each sharded as the projection is; B and C whole where one group is shared by
        every rank."""
        inner, heads = self.intermediate_size, self.num_heads
        groups_state = (columns.numel() - 2 * inner - heads) // 2
        parts = columns.split([inner, inner, groups_state, groups_state, heads])
        shared = groups_state // self.ssm_state_size % self.tp_size != 0
        rank = get_tensor_model_parallel_rank()
        return torch.cat(
            [
                part if shared and i in (2, 3) else part.chunk(self.tp_size)[rank]
                for i, part in enumerate(parts)
            ]
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(
            hidden_states * self.input_scale, mup_vector=self.projection_scale
        )


class FlooredMambaMixer2(MambaMixer2):
    """vLLM's Mamba-2 mixer with the time steps of its prefill tokens floored at
    ``time_step_min`` after their softplus, as the source's chunked scan clamps
    them (its one-token step, a decode, clamps none: nor does this one). As
    softplus is increasing, its input is floored at
    ``softplus^-1(time_step_min) - dt_bias`` instead."""

    def __init__(self, time_step_min: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.time_step_min = time_step_min

    def conv_ssm_forward(self, projected_states: torch.Tensor, output: torch.Tensor):
        metadata = get_forward_context().attn_metadata
        metadata = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        if self.time_step_min <= 0.0 or metadata is None or metadata.num_prefills == 0:
            return super().conv_ssm_forward(projected_states, output)
        decodes = metadata.num_decode_tokens  # vLLM orders a batch's decodes first
        rest, dt = projected_states.split(
            [projected_states.shape[-1] - self.tped_dt_size, self.tped_dt_size], dim=-1
        )
        lowest = self.dt_bias.new_tensor(self.time_step_min, dtype=torch.float32)
        floor = (torch.log(torch.expm1(lowest)) - self.dt_bias.float()).to(dt.dtype)
        dt = torch.cat([dt[:decodes], torch.maximum(dt[decodes:], floor)])
        return super().conv_ssm_forward(torch.cat([rest, dt], dim=-1), output)


class SpanNormMambaMixer2(MambaMixer2):
    """vLLM's Mamba-2 mixer with its gated norm over all its channels at once, as the
    source's is, however many groups its B and C have (vLLM's normalises each group's;
    under tensor parallelism each rank's sum of squares is reduced across ranks)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.norm = Mixer2RMSNormGated(
            self.intermediate_size, 1, self.use_rms_norm, eps=kwargs["rms_norm_eps"]
        )
