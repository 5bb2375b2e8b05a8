"""Mamba-2 blocks that vLLM's ``MambaMixer2`` alone does not compute, proved in real vLLM.

A block whose time steps are floored (NemotronH's ``time_step_min``; here Bamba's
``time_step_limit`` with a floor), proved in real vLLM: the converted file runs its mixer as
``FlooredMambaMixer2`` and equals Hugging Face on a tiny float32 checkpoint whose floor sits
mid-range, so that about half the time steps are raised to it.

Hugging Face floors the time steps of a multi-token forward (its chunked scan) and not those
of a one-token decode step (its recurrent update takes no limits); the file does the same
with vLLM's prefill and decode tokens. The same file with no floor, or with the decode steps
floored too, decodes other tokens: both are run, so the test shows it can fail.

A block with two groups whose gated norm spans all channels (transformers' Bamba and
Mamba-2 blocks) runs as ``SpanNormMambaMixer2`` and equals Hugging Face; the same file with
vLLM's norm over each group's decodes other tokens.
"""

from __future__ import annotations

import math

import pytest

from hfrewrite.cli import main
from hfrewrite.verify.compare import LOGPROB_TOL, VerifyCase, verify_many
from hfrewrite.verify.fixtures import make_tiny_checkpoint

BAMBA = {"mamba_n_heads": 4, "mamba_d_head": 64, "mamba_d_state": 16, "mamba_chunk_size": 4}
# softplus(dt + dt_bias) of the tiny checkpoint is about 1.3: half the steps below this floor
FLOOR = 1.3
_NO_FLOOR = ("if self.time_step_min <= 0.0 or", "if True or")
_DECODES_TOO = (
    ("decodes = metadata.num_decode_tokens", "decodes = 0"),
    (" or metadata.num_prefills == 0:", ":"),
)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("floor")
    ckpt = make_tiny_checkpoint(
        "bamba",
        root / "ckpt",
        num_hidden_layers=3,
        attn_layer_indices=[1],
        time_step_limit=(FLOOR, math.inf),
        **BAMBA,
    )
    assert main(["convert", str(ckpt), "-o", str(root / "out"), "--no-verify"]) == 0
    source = (root / "out" / "bamba.py").read_text()
    files = {"generated": source, "no floor": source.replace(*_NO_FLOOR)}
    files["decodes floored too"] = source
    for old, new in _DECODES_TOO:
        files["decodes floored too"] = files["decodes floored too"].replace(old, new)
    for name, text in files.items():
        assert name == "generated" or text != source, name  # each mutation applied
        (root / f"{name.replace(' ', '_')}.py").write_text(text)
    cases = [VerifyCase(ckpt, root / f"{name.replace(' ', '_')}.py") for name in files]
    return source, dict(zip(files, verify_many(cases)))


@pytest.mark.vllm
def test_the_floored_mixer_equals_hugging_face(reports):
    source, found = reports
    assert "self.mamba = FlooredMambaMixer2(" in source
    assert "time_step_min=config.time_step_limit[0]," in source
    report = found["generated"]
    assert report.hf_tokens and len(set(report.hf_tokens[3])) > 4, "greedy decoding degenerated into repeats"
    assert report.generated_tokens == report.hf_tokens, report.summary()
    assert report.logprob_diff_hf is not None and report.logprob_diff_hf <= LOGPROB_TOL, report.summary()
    assert report.generated_class.startswith("hfrewrite_generated_"), report.summary()


@pytest.mark.vllm
@pytest.mark.parametrize("mutation", ["no floor", "decodes floored too"])
def test_another_floor_decodes_other_tokens(reports, mutation):
    report = reports[1][mutation]
    assert report.generated_tokens is not None, report.summary()
    assert report.generated_tokens != report.hf_tokens, report.summary()


@pytest.mark.vllm
def test_a_norm_over_all_groups_equals_hugging_face(tmp_path):
    ckpt = make_tiny_checkpoint(
        "bamba", tmp_path / "ckpt", num_hidden_layers=3, attn_layer_indices=[1], mamba_n_groups=2, **BAMBA
    )
    assert main(["convert", str(ckpt), "-o", str(tmp_path / "out"), "--no-verify"]) == 0
    source = (tmp_path / "out" / "bamba.py").read_text()
    assert "self.mamba = SpanNormMambaMixer2(" in source and "config.mamba_n_groups == 1" not in source
    grouped = source.replace("self.mamba = SpanNormMambaMixer2(", "self.mamba = MambaMixer2(")
    (tmp_path / "grouped.py").write_text(grouped)
    spanned, per_group = verify_many(
        [VerifyCase(ckpt, tmp_path / "out" / "bamba.py"), VerifyCase(ckpt, tmp_path / "grouped.py")]
    )
    assert spanned.hf_tokens and len(set(spanned.hf_tokens[3])) > 4, "greedy decoding degenerated"
    assert spanned.generated_tokens == spanned.hf_tokens, spanned.summary()
    assert spanned.logprob_diff_hf is not None and spanned.logprob_diff_hf <= LOGPROB_TOL, spanned.summary()
    assert per_group.generated_tokens is not None and per_group.generated_tokens != per_group.hf_tokens
