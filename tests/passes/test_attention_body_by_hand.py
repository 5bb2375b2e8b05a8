"""What attention written by hand may do around the proven computation (MPT): size
arithmetic slicing its bias, shape checks that raise, lengths read off the dropped cache.
Anything else stays unrecognised."""

import libcst as cst
import pytest

from hfrewrite.emit.attention_body import attention_branches, reads_dropped_cache

ALLOWED = {"view", "transpose", "matmul", "softmax"}

BIAS_BLOCK = """\
if position_bias is not None:
    if len(position_bias.shape) != 3:
        raise ValueError("expecting 3 dimensions")
    key_index = max(0, position_bias.size(2) - key_length)
    position_bias = position_bias[:, :, key_index:]
    scores = scores + position_bias
"""


def _stmt(src: str) -> cst.BaseStatement:
    return cst.parse_module(src).body[0]


def test_bias_sliced_by_sizes_is_recognised():
    assert attention_branches(_stmt(BIAS_BLOCK), ALLOWED)


@pytest.mark.parametrize("old, new", [("max(0, ", "torch.exp(0, "), ("raise ValueError", "print")])
def test_other_work_in_the_block_is_not(old, new):
    assert not attention_branches(_stmt(BIAS_BLOCK.replace(old, new)), ALLOWED)


def test_lengths_read_off_the_dropped_cache():
    line = "query_length = n if past_key_values is None else n + past_key_values.get_seq_length()\n"
    assert reads_dropped_cache(_stmt(line), {"past_key_values"}, ALLOWED)
    assert not reads_dropped_cache(
        _stmt(line.replace("get_seq_length", "reset")), {"past_key_values"}, ALLOWED
    )
    assert not reads_dropped_cache(_stmt(line), {"layer_past"}, ALLOWED)  # not a dropped input


UPCAST_BLOCK = """\
if attn_weights.dtype == torch.float16:
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(torch.float16)
else:
    attn_weights = nn.functional.softmax(attn_weights, dim=-1)
"""


def test_a_dtype_branch_upcasting_the_softmax_is_recognised():
    """XGLM's float16 branch, which float32 never takes: the casts change precision only."""
    assert attention_branches(_stmt(UPCAST_BLOCK), ALLOWED)
    assert not attention_branches(_stmt(UPCAST_BLOCK.replace(".to(torch.float16)", ".exp()")), ALLOWED)
