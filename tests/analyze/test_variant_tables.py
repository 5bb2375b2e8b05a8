"""The variant tables hold together: each row's reference (what the analysis replays) agrees
with what the file does for that row (vLLM's norm class, vLLM's rope in that style, the
load-time reordering)."""

from types import SimpleNamespace

import libcst as cst
import pytest
import torch
from hfrewrite.passes import load_weights

from hfrewrite.analyze.expert_layouts import ExpertLayout
from hfrewrite.analyze.norm_kinds import NormKind
from hfrewrite.analyze.qkv_layouts import MP_BLOCKS, QkvLayout
from hfrewrite.analyze.rope_styles import RopeStyle

HQ, HK, D, H = 4, 2, 8, 16  # query heads, kv heads, head size, hidden size


def test_each_norm_row_is_what_its_vllm_class_computes():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import layernorm

    x = torch.randn(3, H, generator=torch.Generator().manual_seed(0))
    with set_current_vllm_config(VllmConfig()):
        for kind in NormKind:
            norm = getattr(layernorm, kind.vllm_class)(H, eps=1e-5)
            torch.nn.init.normal_(norm.weight, generator=torch.Generator().manual_seed(1))
            expected = kind.reference(x, 1e-5, norm.weight.data)
            assert torch.allclose(norm.forward_native(x), expected, atol=1e-5), kind


def test_each_rope_row_is_what_vllms_rope_computes_for_its_style():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    d, positions = 16, torch.arange(6)
    q = torch.randn(len(positions), 2 * d, generator=torch.Generator().manual_seed(2))
    with set_current_vllm_config(VllmConfig()):
        for style in RopeStyle:
            rope = get_rope(
                d, max_position=64, rope_parameters={"rope_theta": 10000.0}, is_neox_style=style.is_neox
            )
            got, _ = rope.forward_native(positions, q.clone(), q.clone())
            cos, sin = rope.cos_sin_cache[positions].double().chunk(2, dim=-1)
            heads = q.double().view(len(positions), 2, d)
            want = style.rotate(heads, cos[:, None], sin[:, None]).reshape(len(positions), 2 * d)
            assert torch.allclose(got.double(), want, atol=1e-5), style


def _helper(layout: QkvLayout, attr: str):
    """The load_weights helper the file emits for ``layout``, defined and bound."""
    if layout.holds_q:
        source = load_weights._QKV_REORDER[layout].format(
            attr=attr, heads="num_attention_heads", kv_heads="num_key_value_heads", blocks=MP_BLOCKS
        )
    else:
        described, rows, pick = load_weights._KV_ROWS[layout]
        source = load_weights._KV_SPLIT.format(
            attr=attr, layout=described, rows=rows, pick=pick, kv_heads="num_key_value_heads"
        )
    scope = {"torch": torch}
    exec(source, scope)  # noqa: S102 - the template under test
    config = SimpleNamespace(num_attention_heads=HQ, num_key_value_heads=HK)
    return lambda weights: scope[layout.load_helper](SimpleNamespace(config=config), weights)


@pytest.mark.parametrize("layout", [QkvLayout.PER_HEAD, QkvLayout.GROUPED, QkvLayout.MP_BLOCKS_QVK])
def test_each_reordered_qkv_row_loads_into_blocks(layout):
    # per head and in blocks: as many kv heads as heads; blocks of two heads each
    hq = 2 * MP_BLOCKS if layout is QkvLayout.MP_BLOCKS_QVK else HQ
    hk = HK if layout is QkvLayout.GROUPED else hq
    weight = torch.randn((hq + 2 * hk) * D, H)
    x = torch.randn(1, 1, H)
    lanes = layout.lanes(x @ weight.T, hq, hk, D)  # the roles as the analysis reads them
    ((_, loaded),) = list(_helper(layout, "wqkv")([("layers.0.attn.wqkv.weight", weight)]))
    blocks = QkvLayout.BLOCKS.lanes(x @ loaded.T, hq, hk, D)  # what QKVParallelLinear holds
    assert all(torch.equal(a, b) for a, b in zip(lanes, blocks))
    assert layout not in (QkvLayout.PER_HEAD, QkvLayout.MP_BLOCKS_QVK) or not torch.equal(weight, loaded)


def test_four_blocks_of_q_v_k_differ_from_one_block_per_head_only_past_four_heads():
    out = torch.randn(1, 1, 3 * 2 * MP_BLOCKS * D)
    per_head_qvk = out.reshape(1, 1, 2 * MP_BLOCKS, 3, D)[..., [0, 2, 1], :].unbind(3)
    blocks = QkvLayout.MP_BLOCKS_QVK.lanes(out, 2 * MP_BLOCKS, 2 * MP_BLOCKS, D)
    assert not all(torch.equal(a, b) for a, b in zip(per_head_qvk, blocks))
    out = out[..., : 3 * MP_BLOCKS * D]
    per_head_qvk = out.reshape(1, 1, MP_BLOCKS, 3, D)[..., [0, 2, 1], :].unbind(3)
    blocks = QkvLayout.MP_BLOCKS_QVK.lanes(out, MP_BLOCKS, MP_BLOCKS, D)
    assert all(torch.equal(a, b) for a, b in zip(per_head_qvk, blocks))


@pytest.mark.parametrize("layout", [QkvLayout.KV_BLOCKS, QkvLayout.KV_PER_HEAD])
def test_each_split_kv_row_loads_k_and_v(layout):
    weight = torch.randn(2 * HK * D, H)
    x = torch.randn(1, 1, H)
    k, v = layout.lanes(x @ weight.T, HQ, HK, D)
    loaded = dict(_helper(layout, "key_value")([("layers.0.attn.key_value.weight", weight)]))
    assert sorted(loaded) == ["layers.0.attn.key_value_k.weight", "layers.0.attn.key_value_v.weight"]
    for lane, name in ((k, "key_value_k"), (v, "key_value_v")):
        rows = x @ loaded[f"layers.0.attn.{name}.weight"].T
        assert torch.equal(rows.reshape(1, 1, HK, D), lane)


def test_each_output_gate_row_writes_what_it_replays():
    from hfrewrite.analyze.output_gates import GateActivation

    gate = torch.randn(3, H, generator=torch.Generator().manual_seed(2))
    for row in GateActivation:
        written = eval(row.expression.format(gate="gate"), {"torch": torch, "gate": gate})
        assert torch.equal(written, row.replay(gate)), row


def test_each_router_scoring_row_is_what_vllms_grouped_router_computes():
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import grouped_topk

    from hfrewrite.analyze.router_scorings import Scoring, scoring_computed_by

    experts = 8
    logits = torch.randn(5, experts, generator=torch.Generator().manual_seed(4))
    for scoring in (Scoring.SOFTMAX, Scoring.SIGMOID):
        # every expert chosen, one group: the weights are the scores, by expert id
        weights, ids = grouped_topk(
            torch.zeros(5, 4),
            logits,
            experts,
            False,
            num_expert_group=1,
            topk_group=1,
            scoring_func=scoring.vllm_name or "softmax",
        )
        expected = scoring.reference(logits).gather(1, ids.long())
        assert torch.allclose(weights, expected, atol=1e-6), scoring
        assert all(scoring_computed_by(call) is scoring for call in scoring.calls)
    assert Scoring.CARRIED.calls == () and scoring_computed_by(torch.tanh) is None


def test_each_rope_turn_row_is_what_the_file_builds_for_it():
    # FORWARD: vLLM's get_rope; REVERSED: the template's ReversedRotaryEmbedding, both against
    # the replay's apply_rope turning by the row's sign
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from hfrewrite.analyze.rope import apply_rope
    from hfrewrite.analyze.rope_styles import RopeTurn
    from hfrewrite.emit.templates_io import template_class

    d, positions, theta = 16, torch.arange(6), 10000.0
    x = torch.randn(1, 2, len(positions), d, generator=torch.Generator().manual_seed(5))
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    scope = {}
    reversed_class = template_class("rope.py", "ReversedRotaryEmbedding", {}, {})
    exec(  # noqa: S102 - the template under test
        "import torch\nfrom vllm.model_executor.layers.rotary_embedding import RotaryEmbedding\n"
        + cst.Module(body=[reversed_class]).code,
        scope,
    )
    with set_current_vllm_config(VllmConfig()):
        for turn in RopeTurn:
            if turn is RopeTurn.FORWARD:
                rope = get_rope(d, max_position=64, rope_parameters={"rope_theta": theta}, is_neox_style=True)
            else:
                rope = scope[turn.builds](d, d, 64, theta, True, torch.float32)
            flat = x[0].transpose(0, 1).reshape(len(positions), 2 * d)
            got, _ = rope.forward_native(positions, flat.clone(), flat.clone())
            want = apply_rope(x.double(), positions, inv_freq, 1.0, RopeStyle.NEOX, turn)
            assert torch.allclose(
                got.double(), want[0].transpose(0, 1).reshape(len(positions), 2 * d), atol=1e-5
            )


@pytest.mark.parametrize("layout", list(ExpertLayout))
def test_each_expert_layout_row_reads_and_loads_what_it_stacks(layout):
    # experts stacked in the row's layout: the replay's weights and the emitted loader's
    # split give back each expert's gate, up and down
    from hfrewrite.emit.expert_weights import _stacked_experts_helper

    e, i, h = 3, 4, 5
    gen = torch.Generator().manual_seed(6)
    gate, up, down = (
        torch.randn(e, i, h, generator=gen),
        torch.randn(e, i, h, generator=gen),
        torch.randn(e, h, i),
    )
    gate_up = (
        torch.stack((gate, up), dim=2).flatten(1, 2) if layout.interleaved else torch.cat((gate, up), dim=1)
    )
    stacked = SimpleNamespace(
        gate_up_proj=gate_up.transpose(1, 2) if layout.transposed else gate_up,
        down_proj=down.transpose(1, 2) if layout.transposed else down,
    )
    got_gate, got_up, got_down, _ = layout.weights(stacked)
    assert all(torch.equal(a, b) for a, b in zip([*got_gate, *got_up, *got_down], [*gate, *up, *down]))
    moe = SimpleNamespace(experts_layout=layout, experts_bias=False, experts="experts", checkpoint_renames=())
    scope = {}
    exec(cst.Module(body=[_stacked_experts_helper(moe)]).code, scope)  # noqa: S102 - the loader under test
    loaded = dict(
        scope["_experts_one_by_one"](
            None,
            [("m.experts.gate_up_proj", stacked.gate_up_proj), ("m.experts.down_proj", stacked.down_proj)],
        )
    )
    for x in range(e):
        assert torch.equal(loaded[f"m.experts.{x}.gate_proj.weight"], gate[x])
        assert torch.equal(loaded[f"m.experts.{x}.up_proj.weight"], up[x])
        assert torch.equal(loaded[f"m.experts.{x}.down_proj.weight"], down[x])
    assert layout.needs_split is (layout is not ExpertLayout.HALVES)
