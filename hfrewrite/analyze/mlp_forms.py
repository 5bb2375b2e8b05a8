"""The forms of a dense MLP the rewrite shards, as rows: what the analysis proves of the code
between the projections, and which projections the file shards by columns.

Every form shards ``down`` by rows (``RowParallelLinear``, which sums the ranks' parts).
A new form is one row here, its proof in the analysis and its tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class MlpForm(Enum):
    """``label``: the --explain wording."""

    # down(act(gate(x)) * up(x)) with vLLM's *AndMul: gate and up merged, the act replaced
    AND_MUL = "MergedColumnParallelLinear + *AndMul"
    # down(act(up(x))), act proven elementwise: up by columns
    UNGATED = "ColumnParallelLinear, the source's elementwise act"
    # down(f(gate(x), up(x))), f proven to compute lane i from gate and up lane i alone
    # (a clamped SwiGLU, an act vLLM has no *AndMul for): gate and up by columns
    PAIRWISE = "no *AndMul computes its act: the source's act per gate/up lane"

    @property
    def label(self) -> str:
        return self.value

    def column_sharded(self, plan) -> tuple[tuple[str, str], ...]:
        """(attribute, vLLM class) of the projections this form shards by columns, beside
        ``down``; AND_MUL's merged projection is passes/fuse_gate_up.py's."""
        if self is MlpForm.UNGATED:
            return ((plan.up.attr, "ColumnParallelLinear"),)
        if self is MlpForm.PAIRWISE and plan.fused_gate_up:  # one [gate; up] Linear: halves merged
            return ((plan.up.attr, "MergedColumnParallelLinear"),)
        if self is MlpForm.PAIRWISE:
            return ((plan.gate.attr, "ColumnParallelLinear"), (plan.up.attr, "ColumnParallelLinear"))
        return ()


@dataclass(frozen=True)
class KeptMlp:
    """A feed-forward class no rewrite fits (a dense MLP no form fits, experts vLLM's fused
    MoE is not proven to compute), kept from the source (analyze/carried_mlp.py): the
    Linears its block calls, attributes of the class, become vLLM's ``ReplicatedLinear``
    (the whole weight on every rank, quantized as vLLM's other linears are)."""

    module_class: str
    linears: tuple[str, ...]
    # the decoder layer's attribute holding a torch nn.Sequential proven Linear -> elementwise
    # -> Linear (CTRL's ffn): built as vLLM's column- and row-parallel pair instead
    parallel_at: str = ""
