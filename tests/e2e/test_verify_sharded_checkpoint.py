"""``hfrewrite verify CHECKPOINT_DIR --generated FILE`` on weights saved as a user's are:
``save_pretrained`` shards (safetensors with an index), float32 and bfloat16."""

from __future__ import annotations

from pathlib import Path

import pytest

from hfrewrite.cli import main
from hfrewrite.verify.fixtures import make_tiny_checkpoint

GOLDEN = Path(__file__).resolve().parents[2] / "golden"


def sharded_checkpoint(root: Path, dtype: str) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    tiny = make_tiny_checkpoint("llama", root / "tiny", seed=5)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=getattr(torch, dtype))
    out = root / dtype
    model.save_pretrained(out, max_shard_size="300KB")
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) > 1
    return out


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_a_sharded_checkpoint(tmp_path, capsys, dtype):
    ckpt = sharded_checkpoint(tmp_path, dtype)
    code = main(["verify", str(ckpt), "--generated", str(GOLDEN / "llama.py"), "--dtype", dtype])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.strip().splitlines()
    assert lines[-1] == "verified"
    assert sum(line.startswith("prompt ") for line in lines) == 4  # no tokenizer: token-id prompts
    if dtype == "float32":
        assert all("16 greedy tokens equal" in line for line in lines if line.startswith("prompt "))
    assert f"in {dtype})" in lines[-2]
