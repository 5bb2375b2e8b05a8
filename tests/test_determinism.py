"""The same input gives byte-identical files on every run, whatever the hash seed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
HFREWRITE = Path(sys.executable).parent / "hfrewrite"


@pytest.mark.slow
def test_convert_is_byte_identical_across_hash_seeds(tmp_path):
    outputs = []
    for seed in ("0", "4242"):
        out = tmp_path / seed
        subprocess.run(
            [str(HFREWRITE), "convert", "--no-verify", "qwen3", "-o", str(out)],
            check=True,
            capture_output=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        outputs.append((out / "qwen3.py").read_bytes())
    assert outputs[0] == outputs[1] == (GOLDEN / "qwen3.py").read_bytes()
