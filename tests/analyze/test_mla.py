"""Multi-head latent attention (analyze/mla.py): roles and sizes from the data flow, the
rope style from the replay, the forward's config switches recorded; mutations of the
attention are refused, never converted wrong."""

from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as dm

from hfrewrite.analyze.mla_cache import MlaCache
from hfrewrite.analyze.model import analyze
from hfrewrite.analyze.plan import MlaPlan
from hfrewrite.analyze.rope_styles import RopeStyle
from hfrewrite.errors import HfrewriteError

GOLDEN = Path(__file__).resolve().parents[2] / "golden"


def mla_plan(model_type="deepseek_v3", **overrides) -> MlaPlan:
    return analyze(transformers.AutoConfig.for_model(model_type, **overrides)).attention


def test_deepseek_v3_latent_attention_facts():
    att = mla_plan()
    assert isinstance(att, MlaPlan)
    assert (att.q_a, att.q_a_norm, att.q_b) == ("q_a_proj", "q_a_layernorm", "q_b_proj")
    assert (att.kv_a, att.kv_a_norm, att.kv_b, att.o) == (
        "kv_a_proj_with_mqa",
        "kv_a_layernorm",
        "kv_b_proj",
        "o_proj",
    )
    # the shrunken sizes: distinct, and the latent what vLLM's CPU MLA backend caches
    assert (
        att.num_heads,
        att.qk_nope_head_dim,
        att.qk_rope_head_dim,
        att.v_head_dim,
    ) == (4, 48, 64, 80)
    assert (att.kv_lora_rank, att.q_lora_rank) == (512, 96)
    assert att.scaling == pytest.approx(112**-0.5)
    assert att.rope_style is RopeStyle.GPTJ  # rope_interleave: GPT-J pairs, proven by replay
    assert dict(att.dims)["qk_head_dim"] == "qk_head_dim" and dict(att.dims)["hidden_size"] == "hidden_size"
    # the query switch is carried (both queries proven: test_both_queries_and_ropes_are_proven);
    # the rope style switch is refused in the file
    assert dict(att.config_branches) == {"self.config.rope_interleave": True}
    assert att.q_switch == ("self.q_lora_rank is None", False) and att.q_other == "q_proj"


def test_both_queries_and_ropes_are_proven_on_sibling_configs():
    """Every released DeepSeek config is one of: low-rank query or none, YaRN or not. The
    traced config proves one of each; sibling configs prove the others."""
    from hfrewrite.analyze.model import analyze as plan_of

    for model_type in ("deepseek_v2", "deepseek_v3"):
        plan = plan_of(transformers.AutoConfig.for_model(model_type))
        att = plan.attention
        assert att.rope_kinds == ("default", "deepseek_yarn")
        assert (att.q_a, att.q_b, att.q_other) == ("q_a_proj", "q_b_proj", "q_proj")
        assert [what for what, _ in plan.sibling_configs][:2] == [
            "no low-rank query (q_lora_rank None)",
            "a YaRN rope",
        ]  # (deepseek_v2's router adds its own: tests/analyze/test_moe_variants.py)
        assert plan.sibling_configs[0][1].q_lora_rank is None
        assert plan.sibling_configs[1][1].rope_parameters["rope_type"] == "yarn"
    # traced without a low-rank query, the sibling proves one
    lite = mla_plan("deepseek_v2", q_lora_rank=None)
    assert (lite.q_a, lite.q_b, lite.q_other) == ("q_a_proj", "q_b_proj", "q_proj")


def test_a_branch_whose_plan_differs_stays_refused(monkeypatch):
    """A sibling whose attention is not the same MLA but for the query (here: its rope style
    differs) is not carried: the file keeps refusing that config, and --explain says why."""
    from hfrewrite.analyze import mla_variants

    real = mla_variants._flip_query

    def more_heads(config, plan):
        what, sibling = real(config, plan)
        sibling.rope_interleave = False
        return what, sibling

    monkeypatch.setattr(mla_variants, "_flip_query", more_heads)
    plan = analyze(transformers.AutoConfig.for_model("deepseek_v3"))
    assert plan.attention.q_switch is None and plan.attention.q_other is None
    assert any("the plan differs in rope_style" in n.reason for n in plan.declined)
    assert [what for what, _ in plan.sibling_configs] == ["a YaRN rope"]


def test_rope_style_follows_the_config_switch():
    att = mla_plan(rope_interleave=False)
    assert att.rope_style is RopeStyle.NEOX and ("self.config.rope_interleave", False) in att.config_branches


def test_deepseek_v2_without_a_low_rank_query():
    from hfrewrite.analyze.model import _analyze

    config = transformers.AutoConfig.for_model("deepseek_v2", q_lora_rank=None)
    att = _analyze(config, branches=False).attention  # the traced branch alone
    assert (att.q_a, att.q_a_norm, att.q_b, att.q_lora_rank) == (
        None,
        None,
        "q_proj",
        None,
    )
    assert "q_lora_rank" not in dict(att.dims)
    assert ("self.q_lora_rank is None", True) in att.config_branches


def test_golden_carries_both_queries_and_refuses_what_its_trace_did_not_take():
    src = (GOLDEN / "deepseek_v3.py").read_text()
    assert "if not (config.rope_interleave):" in src
    init, forward = src.split("class DeepseekV3Attention", 1)[1].split("def forward", 1)
    assert "if config.q_lora_rank is None:\n            self.kv_a_proj_with_mqa = ReplicatedLinear(" in init
    assert (
        "if self.q_lora_rank is None:\n            kv_lora = self.kv_a_proj_with_mqa(hidden_states)[0]"
        in forward
    )
    # without a low-rank query nothing is stacked into fused_qkv_a_proj at load
    assert "if self.config.q_lora_rank is None:" in src.split("def load_weights", 1)[1]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"attention_bias": True}, "a biased projection"),
        (
            {
                "rope_parameters": {
                    "rope_type": "dynamic",
                    "factor": 2.0,
                    "rope_theta": 10000.0,
                }
            },
            "rope_type .dynamic.: only YaRN and the static ropes",
        ),
    ],
)
def test_what_vllm_mla_does_not_compute_is_refused(change, reason):
    with pytest.raises(HfrewriteError, match=f"DeepseekV3Attention: mla_attention: {reason}"):
        mla_plan(**change)


def test_a_rope_on_q_only_is_refused(monkeypatch):
    orig = dm.apply_rotary_pos_emb_interleave
    monkeypatch.setattr(
        dm,
        "apply_rotary_pos_emb_interleave",
        lambda q, k, cos, sin: (orig(q, k, cos, sin)[0], k),
    )
    with pytest.raises(HfrewriteError, match="the replay of vLLM's MLA"):
        mla_plan()


def test_multi_token_prediction_layers_are_skipped_at_load():
    # DeepSeek-V3 and GLM-4.5 Hub checkpoints hold them after the last decoder layer.
    assert (
        analyze(transformers.AutoConfig.for_model("deepseek_v3")).mtp_layers_field
        == "num_nextn_predict_layers"
    )
    assert analyze(transformers.AutoConfig.for_model("deepseek_v2")).mtp_layers_field is None
    golden = (Path(__file__).resolve().parents[2] / "golden" / "deepseek_v3.py").read_text()
    assert ">= self.config.num_hidden_layers" in golden.split("def load_weights", 1)[1].split("def ", 1)[0]


def test_yarn_is_proven_as_vllms_deepseek_yarn_and_other_ropes_are_guarded():
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    }
    assert mla_plan(rope_parameters=yarn, max_position_embeddings=16384).rope_kind == "deepseek_yarn"
    assert mla_plan().rope_kind == "default"
    # the golden, traced with the default rope, runs a YaRN config as vLLM's deepseek_yarn and
    # refuses any other rope type
    golden = (Path(__file__).resolve().parents[2] / "golden" / "deepseek_v3.py").read_text()
    assert (
        'rope_parameters.get("rope_type", "default") not in (\n            "default",\n            "yarn",'
        in golden
    )
    assert '{**config.rope_parameters, "rope_type": "deepseek_yarn"}' in golden


def test_the_scores_tell_a_yarn_table_from_the_default_one():
    # At the example's 5 positions the two tables differ in the slow lanes only, by little:
    # DeepSeek's Hub code with R1's YaRN passed the output replay with the default table
    # (validation caught it). The q.k scores before the softmax tell them apart.
    from torch import nn

    from hfrewrite.analyze.mla import _same_scores, mla_qkv
    from hfrewrite.analyze.rope import _inv_freq, deepseek_yarn

    torch.manual_seed(0)
    hidden, heads, nope, rope, v_head, lora = 128, 4, 32, 32, 32, 64

    def linear(n_in, n_out):
        layer = nn.Linear(n_in, n_out, bias=False)
        nn.init.normal_(layer.weight, std=0.02)  # transformers' initializer_range
        return layer

    fns = {
        "q_b": linear(hidden, heads * (nope + rope)),
        "kv_a": linear(hidden, lora + rope),
        "kv_a_norm": nn.RMSNorm(lora),
        "kv_b": linear(lora, heads * (nope + v_head)),
        "o": linear(heads * v_head, hidden),
    }
    params = {"rope_theta": 1e4, "factor": 40, "original_max_position_embeddings": 4096}
    tables = {"yarn": deepseek_yarn(params, rope), "default": _inv_freq(None, params, None, rope)}
    x = torch.randn(2, 5, hidden)
    qkv = {
        kind: mla_qkv(x, fns, heads, nope, rope, v_head, lora, freq, RopeStyle.GPTJ)
        for kind, freq in tables.items()
    }
    assert _same_scores(*qkv["yarn"][:2], *qkv["yarn"][:2])
    assert not _same_scores(*qkv["yarn"][:2], *qkv["default"][:2])


def test_mla_rope_types_whose_table_vllm_fixes_otherwise_are_refused():
    # transformers recomputes the dynamic NTK table past max_position_embeddings, vLLM does not
    with pytest.raises(HfrewriteError, match="only YaRN and the static ropes"):
        mla_plan(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})


def test_mla_static_ropes_are_proven_and_passed_to_get_rope_as_they_are():
    plan = mla_plan(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})
    assert (plan.rope_kind, plan.rope_kinds) == ("linear", ("linear",))  # no sibling rope
    longrope = {  # MiniCPM3's released rope: 16 factors each, fitted to the shrunk head
        "rope_type": "longrope",
        "rope_theta": 1e4,
        "factor": 1.0,
        "original_max_position_embeddings": 4096,
        "short_factor": [1.0 + 0.1 * i for i in range(16)],
        "long_factor": [1.0 + i for i in range(16)],
    }
    plan = mla_plan("minicpm3", rope_parameters=longrope, max_position_embeddings=4096)
    assert plan.rope_kind == "longrope" and plan.rope_style is RopeStyle.NEOX


def test_mla_in_a_type_vllm_gives_no_latent_cache_runs_per_head():
    # MLA-shaped attention under a model type vLLM 0.32 sizes a per-head KV cache for
    # (minicpm3's case; here deepseek_v3's code under another name)
    config = transformers.AutoConfig.for_model("deepseek_v3")
    assert analyze(config).attention.kv_cache is MlaCache.LATENT
    config.model_type = "renamed_deepseek"
    assert analyze(config).attention.kv_cache is MlaCache.PER_HEAD


def test_per_head_mla_with_v_heads_wider_than_qk_heads_is_refused(monkeypatch):
    # the per-head file pads v to the q/k head size: a wider v has no such layout
    from hfrewrite.analyze import shrink

    shrink_mla = shrink._shrink_mla

    def wide_v(config, small):
        shrink_mla(config, small)
        small.v_head_dim = 160  # q/k heads: 48 + 64

    monkeypatch.setattr(shrink, "_shrink_mla", wide_v)
    config = transformers.AutoConfig.for_model("deepseek_v3")
    assert analyze(config).attention.v_head_dim == 160
    config.model_type = "renamed_deepseek"
    with pytest.raises(HfrewriteError, match=r"v heads \(160\) wider than q/k heads \(112\)"):
        analyze(config)


def test_mla_types_are_the_installed_vllms():
    import importlib.util

    from hfrewrite.analyze.mla_cache import VLLM_MLA_TYPES

    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vLLM is not installed")
    source = (Path(spec.origin).parent / "transformers_utils" / "model_arch_config_convertor.py").read_text()
    start = source.index("def is_deepseek_mla")
    listed = source[start : source.index("\n    def ", start + 1)]
    assert {t for t in VLLM_MLA_TYPES if f'"{t}"' not in listed} == set()
