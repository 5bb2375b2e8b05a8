"""``convert --configs DIR``: released configs loaded as vLLM builds them; bad input is one line."""

import json
from pathlib import Path

import pytest

from hfrewrite.cli import main
from hfrewrite.config_matrix import load_configs
from hfrewrite.errors import HfrewriteError

HUB = Path(__file__).resolve().parent / "data" / "hub_configs"


def test_released_configs_load_with_sizes_as_released():
    configs = dict(load_configs(HUB / "deepseek_v3", "deepseek_v3"))
    v3 = configs["deepseek-ai__DeepSeek-V3"]
    assert (v3.hidden_size, v3.num_hidden_layers, v3.q_lora_rank, v3.kv_lora_rank) == (7168, 61, 1536, 512)
    assert v3.rope_parameters["rope_type"] == "yarn" and v3.rope_parameters["factor"] == 40
    assert getattr(v3, "quantization_config", None) is None  # fp8 weights: not the architecture
    assert configs["moonshotai__Moonlight-16B-A3B-Instruct"].q_lora_rank is None


def test_every_stored_config_is_its_directorys_type():
    for directory in sorted(p for p in HUB.iterdir() if p.is_dir()):
        assert load_configs(directory, directory.name), directory


@pytest.mark.parametrize(
    ("setup", "says"),
    [
        (lambda d: None, "no such directory"),
        (lambda d: d.mkdir(), "no *.json config files"),
        (lambda d: (d.mkdir(), (d / "a.json").write_text("{")), "not a readable JSON config"),
        (
            lambda d: (d.mkdir(), (d / "a.json").write_text(json.dumps({"model_type": "qwen3"}))),
            "model_type 'qwen3'",
        ),
    ],
)
def test_bad_config_directories_are_one_clear_error(tmp_path, setup, says):
    setup(tmp_path / "configs")
    with pytest.raises(HfrewriteError, match=says.replace("*", r"\*")):
        load_configs(tmp_path / "configs", "llama")


def test_configs_cannot_go_without_validation(tmp_path, capsys):
    code = main(
        ["convert", "llama", "--no-verify", "--configs", str(HUB / "llama"), "-o", str(tmp_path / "o")]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "cannot go with --no-verify" in err
    assert not (tmp_path / "o").exists()
