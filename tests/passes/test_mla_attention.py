"""mla_attention: DeepSeek's latent attention -> vLLM's MLAAttention with fused q_a/kv_a
projections, get_rope (default or deepseek_yarn) and the compressed KV cache. The source is
the installed (pinned) transformers' class; the whole rewritten class is in data/."""

import dataclasses
import inspect
from pathlib import Path

import transformers
from harness import assert_rewrites, rewrite
from hfrewrite.passes import mla_attention
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as dm

from hfrewrite.analyze.mla_cache import MlaCache
from hfrewrite.analyze.model import analyze

AFTER = (Path(__file__).parent / "data" / "deepseek_v3_attention.mla.txt").read_text()


def deepseek_v3_plan():
    return analyze(transformers.AutoConfig.for_model("deepseek_v3"))


def test_deepseek_v3_attention_becomes_vllm_mla():
    assert_rewrites(mla_attention, inspect.getsource(dm.DeepseekV3Attention), AFTER, deepseek_v3_plan())


def test_a_4x_config_s_rope_scaling_is_gathered_before_the_rope_is_read():
    # DeepSeek-R1's Hub code under transformers 4: YaRN under config.rope_scaling["type"]
    plan = deepseek_v3_plan()
    plan = dataclasses.replace(
        plan, attention=dataclasses.replace(plan.attention, rope_source="rope_scaling")
    )
    out = rewrite(mla_attention, inspect.getsource(dm.DeepseekV3Attention), plan)
    init = out.split("    def forward(", 1)[0]
    gathered = "rope_parameters = {**config.rope_parameters, **(config.rope_scaling or {})}\n"
    assert gathered in init and "config.rope_parameters.get(" not in init
    assert init.index(gathered) < init.index('if rope_parameters.get("rope_type", "default") not in')
    assert '{**rope_parameters, "rope_type": "deepseek_yarn"}' in init


PER_HEAD_AFTER = (Path(__file__).parent / "data" / "deepseek_v3_attention.mla_per_head.txt").read_text()


def test_a_type_without_a_latent_cache_runs_per_head_attention():
    # vLLM 0.32 sizes a per-head cache for a type it does not list (minicpm3, youtu): the
    # latent expanded into k and v per head, v padded to the q/k head size, vLLM's Attention
    plan = deepseek_v3_plan()
    plan = dataclasses.replace(
        plan, attention=dataclasses.replace(plan.attention, kv_cache=MlaCache.PER_HEAD)
    )
    assert_rewrites(mla_attention, inspect.getsource(dm.DeepseekV3Attention), PER_HEAD_AFTER, plan)
