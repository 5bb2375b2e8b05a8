"""row_parallel: output projections -> RowParallelLinear, tuple results unpacked."""

import pytest
from harness import assert_rewrites, rewrite
from hfrewrite.passes import row_parallel
from plans import llama_like

from hfrewrite.errors import HfrewriteError

BEFORE_ASSIGNMENT_AND_NESTED_CALL = """\
class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, attn_output):
        attn_output = self.o_proj(attn_output)
        return attn_output


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        return self.down_proj(x) + 1
"""

AFTER_ASSIGNMENT_AND_NESTED_CALL = """\
class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )

    def forward(self, attn_output):
        attn_output, _ = self.o_proj(attn_output)
        return attn_output


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.down_proj = RowParallelLinear(
            config.intermediate_size,
            config.hidden_size,
            bias=True,
            quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )

    def forward(self, x):
        return self.down_proj(x)[0] + 1
"""


def test_assignment_and_nested_call():
    assert_rewrites(
        row_parallel, BEFORE_ASSIGNMENT_AND_NESTED_CALL, AFTER_ASSIGNMENT_AND_NESTED_CALL, llama_like()
    )


REFUSED_NOT_LINEAR = """\
class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.o_proj = Conv1D(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, attn_output):
        attn_output = self.o_proj(attn_output)
        return attn_output


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        return self.down_proj(x) + 1
"""


def test_refuses_not_linear():
    with pytest.raises(HfrewriteError, match="is not nn.Linear"):
        rewrite(row_parallel, REFUSED_NOT_LINEAR, llama_like())


def test_the_shared_expert_class_can_leave_the_reduction_to_the_moe_runner():
    import dataclasses

    from plans import qwen_moe

    source = BEFORE_ASSIGNMENT_AND_NESTED_CALL.replace("Llama", "Qwen3Moe")
    shared = rewrite(row_parallel, source, qwen_moe(shared=True))
    assert "def __init__(self, config, reduce_results: bool = True):" in shared
    assert (
        "bias=True,\n            reduce_results=reduce_results,\n            quant_config=quant_config,"
        in shared
    )
    plan = qwen_moe(shared=True)
    no_shared = dataclasses.replace(
        plan,
        moe=dataclasses.replace(plan.moe, shared_expert=None, shared_expert_gate=None),
    )
    assert "reduce_results" not in rewrite(row_parallel, source, no_shared)
