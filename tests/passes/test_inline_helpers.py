"""inline_helpers: a helper method holding the projections is inlined into the forward that
calls it; the inlined class computes what the original one did (run on values here)."""

from textwrap import dedent

import torch
from harness import apply
from hfrewrite.passes import inline_helpers
from plans import llama_like

SOURCE = """\
import torch
from torch import nn

SCALE = 2.0


class LlamaAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(8, 8)
        self.k_proj = nn.Linear(8, 4)
        self.v_proj = nn.Linear(8, 4)

    def _project(self, hidden_states, cache, use_cache=True):
        \"\"\"q, k, v and the cache.\"\"\"
        n = hidden_states.shape[0]
        q = self.q_proj(hidden_states) * SCALE
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        if cache is not None:
            k = k + cache
        cache = k if use_cache else None
        return q, k, v + n, cache

    def forward(self, hidden_states, cache=None):
        n = hidden_states.shape[-1]
        q, k, v, cache = self._project(hidden_states, cache)
        return q.sum(-1) + k.sum(-1) + v.sum(-1) + n, cache
"""


def _classes(source: str) -> type:
    namespace: dict = {}
    exec(compile(source, "<test>", "exec"), namespace)  # noqa: S102 -- the test's own snippet, run to compare
    return namespace["LlamaAttention"]


def _same_outputs(before: str, after: str) -> None:
    torch.manual_seed(0)
    original = _classes(before)()
    inlined = _classes(after)()
    inlined.load_state_dict(original.state_dict())
    x, cache = torch.randn(3, 8), torch.randn(3, 4)
    for args in ((x,), (x, cache)):
        got, want = inlined(*args), original(*args)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_helper_holding_the_projections_is_inlined_and_computes_the_same():
    result = apply(inline_helpers, SOURCE, llama_like())
    out = result.module.code
    assert result.matches == 1
    forward = out[out.index("    def forward") :]
    assert "self._project(" not in forward and "self.q_proj(hidden_states) * SCALE" in forward
    assert "n_ = hidden_states.shape[0]" in forward  # the caller's own n is left alone
    assert "use_cache = True" in forward  # the default, bound
    assert "v = v + n_" in forward  # the returned tuple, pairs already equal left out
    _same_outputs(dedent(SOURCE), out)


def test_a_helper_with_nothing_the_fusing_passes_look_for_stays():
    source = SOURCE.replace("self.q_proj(hidden_states)", "hidden_states").replace(
        "self.k_proj(hidden_states)", "hidden_states[:, :4]"
    )
    source = source.replace("self.v_proj(hidden_states)", "hidden_states[:, 4:]")
    result = apply(inline_helpers, source, llama_like())
    assert result.matches == 0 and result.module.code == dedent(source)


def test_an_early_return_keeps_the_call():
    source = SOURCE.replace(
        "        n = hidden_states.shape[0]\n",
        "        if cache is None:\n            return 1\n        n = 0\n",
    )
    assert apply(inline_helpers, source, llama_like()).matches == 0


def test_a_helper_reading_a_name_the_caller_assigns_stays():
    source = SOURCE.replace(
        "        n = hidden_states.shape[-1]\n", "        SCALE = 3.0\n        n = hidden_states.shape[-1]\n"
    )
    assert apply(inline_helpers, source, llama_like()).matches == 0


def test_star_arguments_keep_the_call():
    source = SOURCE.replace("self._project(hidden_states, cache)", "self._project(*(hidden_states, cache))")
    assert apply(inline_helpers, source, llama_like()).matches == 0


def test_a_helper_calling_super_stays():
    source = SOURCE.replace(
        "        n = hidden_states.shape[0]\n", "        n = super().__class__ and hidden_states.shape[0]\n"
    )
    assert apply(inline_helpers, source, llama_like()).matches == 0
