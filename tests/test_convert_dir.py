"""Converting a local checkpoint directory through the real pipeline."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hfrewrite.emit.output import parse_header

HFREWRITE = Path(sys.executable).parent / "hfrewrite"
GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def _convert(model: Path, config: dict, out: Path, written: str) -> str:
    """The file ``convert --no-verify`` writes for ``config`` saved in ``model``."""
    (model / "config.json").write_text(json.dumps(config))
    subprocess.run(
        [str(HFREWRITE), "convert", "--no-verify", str(model), "-o", str(out)],
        check=True,
        capture_output=True,
    )
    return (out / written).read_text()


def test_local_dir_with_another_architecture_name(tmp_path):
    """A config may name an architecture the modeling source does not define (fine-tunes,
    renamed heads): the source's causal-LM class is rewritten, and since the modeling
    source is the same, the body equals the golden's."""
    model = tmp_path / "my-model"
    model.mkdir()
    config = {
        "model_type": "llama",
        "architectures": ["MyLlamaForCausalLM"],
        "hidden_size": 256,
    }
    text = _convert(model, config, tmp_path / "out", "llama.py")
    assert "class LlamaForCausalLM(" in text
    body = lambda t: t.split("\n\n", 1)[1]
    assert body(text) == body((GOLDEN / "llama.py").read_text())


@pytest.mark.slow
def test_relative_directory_is_recorded_from_the_file_so_check_works_anywhere(tmp_path):
    """A path typed relative to the working directory is recorded relative to the
    generated file's directory: `check` then finds the model from any working directory,
    and the same layout gives the same header on any machine."""
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "work").mkdir()
    run = lambda *argv, cwd: subprocess.run(
        [str(HFREWRITE), *argv], cwd=cwd, check=False, capture_output=True, text=True
    )
    assert run("convert", "--no-verify", "../models/m", "-o", "gen", cwd=tmp_path / "work").returncode == 0
    text = (tmp_path / "work" / "gen" / "llama.py").read_text()
    record = parse_header(text)
    assert (record.model, record.relative_to_file) == ("../../models/m", True)
    header = " ".join(line.lstrip("# ") for line in text.splitlines()[:8])  # cut to 88 columns
    assert "from ../../models/m (local directory, relative to this file)" in header
    for cwd in (tmp_path, tmp_path / "models", Path("/")):
        checked = run("check", str(tmp_path / "work" / "gen"), cwd=cwd)
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_multi_head_gpt_bigcode_splits_its_per_head_projection_in_one_statement(tmp_path):
    """Multi-head gpt_bigcode takes q, k and v apart in one chained statement over a
    projection laid out per head (`c_attn(x).view(...).transpose(1, 2).split(...)`): vLLM's
    split of the fused layer takes its place, and load_weights reorders the checkpoint's
    per-head rows into [q; k; v] (validated in vLLM by the convert-time check)."""
    model = tmp_path / "bigcode-mha"
    model.mkdir()
    config = {"model_type": "gpt_bigcode", "architectures": ["GPTBigCodeForCausalLM"], "multi_query": False}
    text = _convert(model, config, tmp_path / "out", "gpt_bigcode.py")
    assert "qkv, _ = self.c_attn(hidden_states)" in text
    assert "def _qkv_per_head_to_blocks(self, weights):" in text
