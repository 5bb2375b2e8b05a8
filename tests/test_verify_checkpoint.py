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
