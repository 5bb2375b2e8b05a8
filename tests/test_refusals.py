"""Architectures whose patterns do not match are refused with the reason, through the real
pipeline and the console script: one stderr line, exit code 2, nothing written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HFREWRITE = Path(sys.executable).parent / "hfrewrite"


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        # Gated DeltaNet (linear attention) has no q/k/v group.
        ("qwen3_next", "Qwen3NextGatedDeltaNet: fuse_qkv: no group of three linears"),
        # GPT-2 projects q/k/v with one Conv1D: not three linears on one input.
        ("gpt2", "GPT2Attention: fuse_qkv: no group of three linears"),
        # SmolLM3 skips rope on some layers (`if self.use_rope:`): not dropped, refused.
        ("smollm3", "SmolLM3Attention: vllm_attention: forward does something"),
    ],
)
def test_unmatched_architecture_is_refused(tmp_path, model_type, reason):
    out = tmp_path / "out"
    proc = subprocess.run(
        [str(HFREWRITE), "convert", model_type, "-o", str(out)],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("W11")]  # torch's triton notice
    assert len(lines) == 1 and lines[0].startswith("hfrewrite: error: "), proc.stderr
    assert reason in lines[0]
    assert not out.exists() or list(out.iterdir()) == []
