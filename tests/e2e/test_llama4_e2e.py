"""Llama-4's attention, in real vLLM against Hugging Face: chunked layers (vLLM's
``ChunkedLocalAttention``), NoPE layers without rope or q/k norms (the source's tests kept),
the L2 q/k norm after the rope, and the attention temperature on NoPE layers (a factor of
positions the forward makes itself, evaluated on vLLM's positions).

Real Llama-4 checkpoints interleave MoE layers whose experts the analysis does not prove yet:
the converted config here has dense layers only (``moe_layers: []``), and the released
layout is refused with that reason. vLLM's own ``llama4.py`` cannot load a dense-only
checkpoint (it asks for expert weights), so the comparison is with Hugging Face alone.
The checkpoint's ``floor_scale`` of 4 makes the temperature differ from 1 within the
prompts, and its chunks of 32 tokens end inside the longest prompt: a file missing either
is caught (the planted mutations below).
"""

from __future__ import annotations

import pytest

from hfrewrite.cli import main
from hfrewrite.verify.fixtures import make_tiny_checkpoint

pytestmark = pytest.mark.vllm

SCALE = "if self.attn_temperature_tuning and not self.use_rope:"
CHUNKED = "attention_class = ChunkedLocalAttention if chunked else Attention"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from transformers import Llama4TextConfig

    config_dir = tmp_path_factory.mktemp("llama4-dense")
    Llama4TextConfig(moe_layers=[]).save_pretrained(config_dir)
    out = tmp_path_factory.mktemp("out")
    assert main(["convert", str(config_dir), "-o", str(out)]) == 0  # validated in vLLM first
    return (out / "llama4_text.py").read_text()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(
        "llama4_text",
        tmp_path_factory.mktemp("ckpt"),
        moe_layers=[],
        num_hidden_layers=4,  # layer 3 is NoPE: full attention, temperature, no q/k norm
        attention_chunk_size=32,
        floor_scale=4,
        intermediate_size_mlp=256,
    )


def _verify(tmp_path, capsys, checkpoint, text: str):
    path = tmp_path / "llama4_text.py"
    path.write_text(text)
    code = main(["verify", str(checkpoint), "--generated", str(path)])
    return code, capsys.readouterr().out


def test_the_converted_file_keeps_each_layer_kind_of_the_source(converted):
    assert CHUNKED in converted
    assert SCALE in converted
    assert 'if hasattr(self, "qk_norm"):' in converted
    assert "if self.use_rope:" in converted


def test_the_converted_file_equals_hugging_face(tmp_path, capsys, checkpoint, converted):
    code, out = _verify(tmp_path, capsys, checkpoint, converted)
    assert code == 0, out
    assert "16 greedy tokens equal" in out


@pytest.mark.parametrize(
    "planted",
    [(SCALE, "if False:"), (CHUNKED, "attention_class = Attention\n        chunked = {}")],
    ids=["no-temperature", "no-chunks"],
)
def test_a_file_without_the_temperature_or_the_chunks_is_caught(
    tmp_path, capsys, checkpoint, converted, planted
):
    assert converted.count(planted[0]) == 1
    code, out = _verify(tmp_path, capsys, checkpoint, converted.replace(*planted))
    assert code != 0
    assert "FAILED" in out


def test_the_released_layout_is_refused_at_its_experts(tmp_path, capsys):
    code = main(["convert", "llama4_text", "--no-verify", "-o", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert (
        "Llama4TextMoe: fuse_experts: the experts are not called as experts(x, top_k_index, top_k_weights)"
        in err[0]
    )
    assert "it does not return one tensor" in err[0]
    assert not list(tmp_path.iterdir())
