"""gpt_oss: attention sinks, a rope helper splitting heads with torch.chunk, stacked experts
transposed with gate and up interleaved and biased, the clamped swiglu vLLM calls
swigluoai. The layout and the activation are what the replay shows: a source holding gate
and up as halves converts as halves; constants vLLM's kernels do not use are refused."""

import inspect
import textwrap

import pytest
from transformers import AutoConfig
from transformers.models.gpt_oss import modeling_gpt_oss

from hfrewrite.analyze import model as analysis
from hfrewrite.analyze.expert_layouts import ExpertLayout
from hfrewrite.analyze.rope_styles import RopeLayers, RopeStyle
from hfrewrite.errors import HfrewriteError


def _analyze(**fields):
    return analysis.analyze(AutoConfig.for_model("gpt_oss", **fields))


def _patched(monkeypatch, cls, method: str, old: str, new: str) -> None:
    """``cls.method`` compiled from its source with ``old`` replaced by ``new``."""
    source = textwrap.dedent(inspect.getsource(getattr(cls, method)))
    assert source.count(old) == 1, old
    namespace = dict(vars(modeling_gpt_oss))
    exec(source.replace(old, new), namespace)  # noqa: S102
    monkeypatch.setattr(cls, method, namespace[method])


def test_gpt_oss_plan():
    plan = _analyze()
    att, moe = plan.attention, plan.moe
    assert att.sinks == "sinks" and att.rope_layers is RopeLayers.ALL and att.rope_style is RopeStyle.NEOX
    assert (moe.activation, moe.experts_layout, moe.experts_bias) == (
        "swigluoai",
        ExpertLayout.TRANSPOSED_INTERLEAVED,
        True,
    )
    assert (moe.router_bias, moe.renormalize, moe.output_index) == (True, True, 0)
    assert moe.swiglu_attrs == ("alpha", "limit")


def test_gate_and_up_as_halves_convert_as_halves(monkeypatch):
    _patched(
        monkeypatch,
        modeling_gpt_oss.GptOssExperts,
        "_apply_gate",
        "gate_up[..., ::2], gate_up[..., 1::2]",
        "gate_up.chunk(2, dim=-1)",
    )
    assert _analyze().moe.experts_layout is ExpertLayout.TRANSPOSED


def test_swiglu_constants_vllm_does_not_use_are_refused():
    with pytest.raises(HfrewriteError, match="replaying the plan"):
        _analyze(swiglu_limit=0.5)


def test_sinks_that_are_not_one_per_head_are_refused(monkeypatch):
    _patched(
        monkeypatch,
        modeling_gpt_oss.GptOssAttention,
        "forward",
        "s_aux=self.sinks,",
        "s_aux=self.sinks * 2,",
    )
    with pytest.raises(HfrewriteError, match="sinks"):
        _analyze()
