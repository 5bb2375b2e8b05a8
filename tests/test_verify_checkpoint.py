"""verify CHECKPOINT_DIR before anything loads: the memory estimate and the prompts."""

import pytest
import torch
from safetensors.torch import save_file

from hfrewrite.errors import HfrewriteError
from hfrewrite.verify import checkpoint as vc


def test_parameter_count_reads_the_safetensors_headers(tmp_path):
    save_file(
        {"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)},
        tmp_path / "model-1.safetensors",
    )
    save_file({"c": torch.zeros(2, 2, 2)}, tmp_path / "model-2.safetensors")
    assert vc.parameter_count(tmp_path) == 12 + 5 + 8


def test_a_checkpoint_that_does_not_fit_is_refused_before_loading(tmp_path, monkeypatch):
    save_file({"w": torch.zeros(1000, 1000)}, tmp_path / "model.safetensors")
    monkeypatch.setattr(vc, "available_memory", lambda: 2 << 30)
    with pytest.raises(HfrewriteError, match=r"needs about 3\.0 GiB .* 2\.0 GiB is available"):
        vc.check_fits(tmp_path, "float32")
    monkeypatch.setattr(vc, "available_memory", lambda: 64 << 30)
    vc.check_fits(tmp_path, "float32")


def test_no_weights_is_one_clear_error(tmp_path):
    with pytest.raises(HfrewriteError, match="no weights"):
        vc.parameter_count(tmp_path)


def test_prompts_are_token_ids_without_a_tokenizer(tmp_path):
    prompts, texts = vc.checkpoint_prompts(tmp_path)
    assert texts is None and prompts and all(isinstance(t, int) for p in prompts for t in p)


def test_first_divergence():
    from hfrewrite.verify.compare import first_difference

    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1


def _verify_cli(tmp_path, *extra):
    """`hfrewrite verify DIR ...` in a subprocess: (exit code, stderr lines)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "hfrewrite.cli", "verify", str(tmp_path), *extra],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stderr.strip().splitlines()


def _checkpoint(tmp_path, config=None):
    import json

    save_file({"w": torch.zeros(64, 64), "b": torch.zeros(64)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
    return tmp_path / "model.safetensors"


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda b: b[: len(b) // 2], "truncated or corrupted"),  # cut in the data section
        (lambda b: b[:5], "only 5 bytes"),
        (lambda b: b"\xff" * 8 + b[8:], "its header claims"),  # the header length is garbage
        (lambda b: b[:8] + b"\x00" * (len(b) - 8), "its header is not JSON"),
    ],
)
def test_a_damaged_safetensors_file_is_one_line_and_exit_2(tmp_path, damage, says):
    weights = _checkpoint(tmp_path)
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(HfrewriteError, match=says):
        vc.parameter_count(tmp_path)
    code, lines = _verify_cli(tmp_path, "--generated", __file__)
    assert code == 2 and len(lines) == 1 and says in lines[0], lines


def test_custom_code_checkpoints_need_trust_remote_code(tmp_path):
    _checkpoint(tmp_path, {"model_type": "tiny", "auto_map": {"AutoConfig": "configuration_tiny.TinyConfig"}})
    code, lines = _verify_cli(tmp_path, "--generated", __file__)
    assert code == 2 and len(lines) == 1 and "pass --trust-remote-code" in lines[0], lines


def test_an_unknown_option_is_one_line_and_exit_2(tmp_path):
    code, lines = _verify_cli(tmp_path, "--no-such-option")
    assert code == 2 and lines == [
        "hfrewrite: error: unrecognized arguments: --no-such-option (see hfrewrite --help)"
    ]
