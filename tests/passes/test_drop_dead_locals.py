"""drop_dead_locals: a computed local nothing reads goes; anything with a call or a reader stays."""

import pytest
from hfrewrite.passes import drop_dead_locals

from tests.passes.harness import apply, assert_rewrites
from tests.passes.plans import llama_like

BASE = """
class Phi3Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        op_size = config.num_attention_heads * self.head_dim + 2 * (config.num_key_value_heads * self.head_dim)
        self.o_proj = RowParallelLinear(config.hidden_size, config.hidden_size)
"""


def dropped(source: str) -> tuple[str, int]:
    result = apply(drop_dead_locals, source, llama_like())
    return result.module.code, result.matches


def test_an_unread_computed_size_goes():
    assert dropped(BASE)[1] == 1  # one site
    assert_rewrites(drop_dead_locals, BASE.lstrip(), AFTER, llama_like())


AFTER = """\
class Phi3Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.o_proj = RowParallelLinear(config.hidden_size, config.hidden_size)
"""


@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        (
            "op_size = config.num_attention_heads",
            "op_size = compute(config.num_attention_heads)",
            "a call may have effects",
        ),
        (
            "RowParallelLinear(config.hidden_size, config.hidden_size)",
            "RowParallelLinear(op_size, config.hidden_size)",
            "it is read",
        ),
        (
            "        super().__init__()\n",
            "        super().__init__()\n        global op_size\n",
            "declared global",
        ),
    ],
)
def test_the_local_stays(old, new, why):
    assert BASE.count(old) == 1
    code, matches = dropped(BASE.replace(old, new))
    assert "op_size =" in code and matches == 0, why


ROPE_TABLE = "        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))\n"


def test_an_unread_rope_table_of_pure_calls_goes():
    code, matches = dropped(BASE + ROPE_TABLE)
    assert "inv_freq" not in code and matches == 2


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("torch.arange(0, self.head_dim, 2).float()", "torch.randn(0, self.head_dim, 2).float()"),
        ("torch.arange(0, self.head_dim, 2).float()", "self.table.float()"),  # converts a module in place
    ],
)
def test_a_table_from_other_calls_stays(old, new):
    code, _ = dropped(BASE + ROPE_TABLE.replace(old, new))
    assert "inv_freq =" in code


CHAIN = """\
        if config.new_decoder_architecture:
            qkv_out_dim = (config.num_kv_heads * 2 + config.num_attention_heads) * self.head_dim
        elif config.multi_query:
            qkv_out_dim = config.hidden_size + 2 * self.head_dim
        else:
            qkv_out_dim = 3 * config.hidden_size
"""


def test_an_unread_size_chosen_by_an_if_chain_goes():
    # Falcon's per-architecture size of the fused projection QKVParallelLinear now sizes itself
    before = BASE.replace("        op_size = ", CHAIN + "        op_size = ")
    assert_rewrites(drop_dead_locals, before.lstrip(), AFTER, llama_like())


@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        (
            "RowParallelLinear(config.hidden_size, config.hidden_size)",
            "RowParallelLinear(qkv_out_dim, 1)",
            "read",
        ),
        ("            qkv_out_dim = 3 * config.hidden_size\n", "            other = 3\n", "two names"),
        ("        elif config.multi_query:", "        elif check(config):", "a test with a call"),
        (
            "        else:\n            qkv_out_dim = 3",
            "        else:\n            log()\n            qkv_out_dim = 3",
            "two statements",
        ),
    ],
)
def test_the_chain_stays(old, new, why):
    before = BASE.replace("        op_size = ", CHAIN + "        op_size = ")
    assert before.count(old) == 1
    code, _ = dropped(before.replace(old, new))
    assert "if config.new_decoder_architecture:" in code, why
