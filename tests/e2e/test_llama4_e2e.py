"""Llama-4 (``llama4_text``), its golden in real vLLM against Hugging Face and vLLM's own
``llama4.py``: chunked layers (vLLM's ``ChunkedLocalAttention``), NoPE layers without rope or
q/k norms (the source's tests kept), the L2 q/k norm after the rope, the attention
temperature on NoPE layers (a factor of positions the forward makes itself, evaluated on
vLLM's positions), and MoE blocks whose chosen expert runs on its routing weight times the
input (vLLM's ``apply_router_weight_on_input``) beside a shared expert.

Two layouts: every layer MoE (Scout's), and dense and MoE layers interleaved (Maverick's
``interleave_moe_layer_step`` 2). Their chunks of 32 tokens end inside the longest prompt. A
third checkpoint's ``floor_scale`` of 4 makes the temperature differ from 1 within the
prompts; vLLM's own ``llama4.py`` turns the temperature off there (it keeps it for a
``max_model_len`` over 32768 unless the generation config says otherwise), so that one is
compared with Hugging Face only. A file missing the temperature or the chunks, or weighting
the experts' output instead of their input, is caught (the planted mutations below). A
config choosing two experts per token is refused: vLLM weights the experts' input for one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hfrewrite.cli import main
from hfrewrite.verify.compare import LOGPROB_TOL, VerifyCase, verify_many
from hfrewrite.verify.fixtures import make_tiny_checkpoint

pytestmark = pytest.mark.vllm

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "llama4_text.py"
SCALE = "if self.attn_temperature_tuning and not self.use_rope:"
CHUNKED = "attention_class = ChunkedLocalAttention if chunked else Attention"
ON_INPUT = "apply_router_weight_on_input=True,"
COMMON = {
    "num_hidden_layers": 4,  # layer 3 is NoPE: full attention, temperature, no q/k norm
    "attention_chunk_size": 32,
    "num_local_experts": 8,
    "intermediate_size": 64,
    "intermediate_size_mlp": 256,
}
LAYOUTS = {
    "every-layer-moe": {},
    "dense-and-moe-interleaved": {"interleave_moe_layer_step": 2},
    "temperature": {"floor_scale": 4},
}
NATIVE_WITHOUT_TEMPERATURE = {"temperature"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        name: make_tiny_checkpoint("llama4_text", tmp_path_factory.mktemp(name), seed=i, **COMMON, **extra)
        for i, (name, extra) in enumerate(LAYOUTS.items())
    }


@pytest.fixture(scope="module")
def reports(checkpoints):
    found = verify_many([VerifyCase(ckpt, GOLDEN) for ckpt in checkpoints.values()])
    return dict(zip(checkpoints, found))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_golden_equals_hugging_face_and_vllm_native(reports, layout):
    report = reports[layout]
    assert report.generated_tokens == report.hf_tokens, report.summary()
    assert report.logprob_diff_hf is not None and report.logprob_diff_hf <= LOGPROB_TOL, report.summary()
    problems = list(report.problems)
    if layout in NATIVE_WITHOUT_TEMPERATURE:
        assert report.native_tokens != report.hf_tokens, (
            "vLLM native now keeps the temperature: drop the exemption"
        )
        problems = [p for p in problems if "native" not in p]
    else:
        assert report.generated_tokens == report.native_tokens, report.summary()
        assert report.logprob_diff_native is not None and report.logprob_diff_native <= LOGPROB_TOL, (
            report.summary()
        )
    assert problems == [], report.summary()
    assert report.generated_class.startswith("hfrewrite_generated_"), report.summary()


def test_the_golden_keeps_each_layer_kind_of_the_source():
    text = GOLDEN.read_text()
    assert CHUNKED in text
    assert SCALE in text
    assert 'if hasattr(self, "qk_norm"):' in text
    assert "if self.use_rope:" in text
    assert "if self.is_moe_layer:" in text  # __init__ builds a dense MLP or the MoE block
    assert text.count(ON_INPUT) == 1
    assert "if config.num_experts_per_tok != 1:" in text


@pytest.mark.parametrize(
    "planted",
    [
        (SCALE, "if False:"),
        (CHUNKED, "attention_class = Attention\n        chunked = {}"),
        (ON_INPUT, "apply_router_weight_on_input=False,"),
    ],
    ids=["no-temperature", "no-chunks", "weights-on-the-output"],
)
def test_a_file_without_the_temperature_the_chunks_or_the_input_weights_is_caught(
    tmp_path, capsys, checkpoints, planted
):
    text = GOLDEN.read_text()
    assert text.count(planted[0]) == 1
    path = tmp_path / "llama4_text.py"
    path.write_text(text.replace(*planted))
    code = main(["verify", str(checkpoints["temperature"]), "--generated", str(path)])
    out = capsys.readouterr().out
    assert code != 0
    assert "FAILED" in out


def test_two_experts_per_token_are_refused_in_one_line(tmp_path, capsys):
    from transformers import Llama4TextConfig

    config_dir = tmp_path / "config"
    Llama4TextConfig(num_experts_per_tok=2).save_pretrained(config_dir)
    out = tmp_path / "out"
    code = main(["convert", str(config_dir), "--no-verify", "-o", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "config.num_experts_per_tok is 2: vLLM's fused MoE weights the experts' input" in err[0]
    assert not out.exists() or not list(out.iterdir())
