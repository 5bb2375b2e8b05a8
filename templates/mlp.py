"""vLLM-side MLP code the passes insert into a generated file.

Parsed with libcst by ``passes/parallel_sequential.py``, never imported at run time.
"""

import torch
from torch import nn
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.quantization import QuantizationConfig


class ParallelSequential(nn.Module):
    """The source's ``nn.Sequential(Linear, <elementwise layers>, Linear)`` MLP as vLLM's
    column- and row-parallel pair: each rank computes its columns of the intermediate. The
    layers between the two are the source's own, and every child keeps its index, so the
    checkpoint's names (``ffn.0.weight``, ``ffn.2.weight``) load unchanged."""

    def __init__(
        self,
        build,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        # the source's container, read for its sizes and layers (none holds a tensor but
        # the two Linears, which are replaced)
        with torch.device("meta"):
            source = build()
        names = list(source._modules)
        for name, child in source.named_children():
            if name in (names[0], names[-1]):
                parallel = (
                    ColumnParallelLinear if name == names[0] else RowParallelLinear
                )
                child = parallel(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    quant_config=quant_config,
                    prefix=f"{prefix}.{name}",
                )
            self.add_module(name, child)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for child in self._modules.values():
            hidden_states = child(hidden_states)
            if isinstance(hidden_states, tuple):  # vLLM's linears return (output, bias)
                hidden_states = hidden_states[0]
        return hidden_states
