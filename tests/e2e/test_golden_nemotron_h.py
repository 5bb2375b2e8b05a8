"""The NemotronH golden, proved in real vLLM: layers of one block each, a Mamba-2 mixer
(vLLM's ``MambaMixer2``, its time steps floored at ``time_step_min`` as the source's chunked
scan floors them), an attention without rope or an ungated relu² MLP, each chosen per layer
by the source's ``MIXER_TYPES[self.block_type]``, built by kind in the file.

Tiny float32 checkpoints in the released order (Mamba-2 first) and with attention first:
greedy tokens equal Hugging Face's, chosen-token logprobs within 1e-4, across decode steps (so
the cached states are read back). With the default floor (0.001, below every time step of
these weights) vLLM's own ``nemotron_h.py`` decodes the same tokens; with a floor of 1.3,
which raises about half of them, it does not (it floors nothing), and the file still equals
Hugging Face. A checkpoint with a MoE layer, a kind the golden was not proven with, is
refused when vLLM builds the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hfrewrite.verify.compare import VerifyCase, verify_many
from hfrewrite.verify.fixtures import make_tiny_checkpoint
from tests.e2e.golden_checks import assert_equals_hf, assert_native

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "nemotron_h.py"
SIZES = {
    "mamba_num_heads": 4,
    "mamba_head_dim": 64,
    "n_groups": 2,
    "ssm_state_size": 16,
    "chunk_size": 4,
    "mlp_hidden_act": "relu2",
}
CASES: dict[str, tuple[list[str], dict]] = {
    "mamba-first": (["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp"], {}),
    "attention-first": (["full_attention", "linear_attention", "mlp"], {}),
    "floored": (["linear_attention", "mlp", "full_attention", "linear_attention"], {"time_step_min": 1.3}),
}
# the parallel layers of each kind's block
KINDS = {
    "linear_attention": {"MergedColumnParallelLinear": 2, "RowParallelLinear": 1},  # MambaMixer2
    "full_attention": {"QKVParallelLinear": 1, "RowParallelLinear": 1},
    "mlp": {"ColumnParallelLinear": 1, "RowParallelLinear": 1},
}


def _checkpoint(root: Path, kinds: list[str], seed: int, **overrides) -> Path:
    return make_tiny_checkpoint(
        "nemotron_h",
        root,
        seed=seed,
        num_hidden_layers=len(kinds),
        layers_block_type=kinds,
        **SIZES,
        **overrides,
    )


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cases = [
        VerifyCase(_checkpoint(tmp_path_factory.mktemp(name), kinds, i, **overrides), GOLDEN)
        for i, (name, (kinds, overrides)) in enumerate(CASES.items())
    ]
    return dict(zip(CASES, verify_many(cases)))


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_nemotron_h_golden_matches_hf(reports, case):
    report = reports[case]
    assert_equals_hf(report)
    assert_native(report, case != "floored", "vLLM's nemotron_h.py floors no time step")


@pytest.mark.vllm
@pytest.mark.parametrize("case", list(CASES))
def test_nemotron_h_layers_are_vllms(reports, case):
    """Each layer holds its kind's parallel layers and no plain nn.Linear, as many as in
    vLLM's own file."""
    report = reports[case]
    structure, native = report.generated_structure, report.native_structure
    assert structure and native, report.summary()
    for kind, layer in zip(CASES[case][0], structure):
        assert {name: n for name, n in layer.items() if n} == KINDS[kind], layer
    assert [sum(layer.values()) for layer in structure] == [sum(layer.values()) for layer in native]


@pytest.mark.vllm
def test_a_moe_layer_is_refused_by_the_file(tmp_path):
    """The golden's kinds are the traced ones; a MoE layer was never proven (its ungated
    experts run in vLLM on GPUs only), so vLLM building it stops with the file's reason."""
    ckpt = _checkpoint(
        tmp_path / "moe",
        ["linear_attention", "moe", "full_attention"],
        0,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        moe_shared_expert_intermediate_size=64,
        n_group=1,
        topk_group=1,
    )
    (report,) = verify_many([VerifyCase(ckpt, GOLDEN)])
    assert report.generated_tokens is None, report.summary()
    assert "this file needs self.block_type in" in report.errors.get("generated", ""), report.summary()
