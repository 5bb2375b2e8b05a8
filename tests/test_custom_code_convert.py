"""`convert --trust-remote-code` on Hub custom code: the repository's own modeling file is
the source, refused (one line, exit 2, nothing written) with the reason analysis finds."""

import json
import shutil
from pathlib import Path

import pytest

from hfrewrite.cli import main

DATA = Path(__file__).resolve().parent / "data" / "custom_code"
SDPA = "calls torch's scaled_dot_product_attention directly"


def run(capsys, *argv) -> tuple[int, str]:
    code = main(["convert", "--no-verify", *map(str, argv)])
    return code, capsys.readouterr().err


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("name", ["tinyllama_renamed", "fusedqkv_postnorm", "tinymoe"])
def test_custom_code_needs_the_flag_and_is_analyzed_from_its_own_source(name, tmp_path, capsys):
    repo = shutil.copytree(DATA / name, tmp_path / name)
    out = tmp_path / "out"
    code, err = run(capsys, repo, "-o", out)
    assert code == 2 and "refusing without --trust-remote-code" in err
    code, err = run(capsys, repo, "--trust-remote-code", "-o", out)
    assert code == 2 and err.count("\n") == 1 and SDPA in err, err
    assert not out.exists()


def test_custom_code_that_passes_the_analysis_is_not_written_yet(tmp_path, capsys):
    # the repository's own class, through transformers' attention interface (a llama
    # subclass): analysis proves it; writing custom-code files is refused with the reason
    repo = tmp_path / "myllama"
    repo.mkdir()
    (repo / "configuration_myllama.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass MyLlamaConfig(LlamaConfig):\n    model_type = 'myllama'\n"
    )
    (repo / "modeling_myllama.py").write_text(
        "from transformers.models.llama.modeling_llama import LlamaForCausalLM\n\n"
        "from .configuration_myllama import MyLlamaConfig\n\n\n"
        "class MyLlamaForCausalLM(LlamaForCausalLM):\n    config_class = MyLlamaConfig\n"
    )
    config = {
        "model_type": "myllama",
        "architectures": ["MyLlamaForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_myllama.MyLlamaConfig",
            "AutoModelForCausalLM": "modeling_myllama.MyLlamaForCausalLM",
        },
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
    }
    (repo / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    code, err = run(capsys, repo, "--trust-remote-code", "-o", out)
    assert code == 2 and "writing a vLLM file for custom code is not implemented yet" in err, err
    assert "MyLlamaConfig" in err and not out.exists()
