"""Analysis under the transformers a repository was written for: which release, the cache
it is installed into (offline: one clear line), and the config shim the file carries."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import libcst as cst
import pytest

from hfrewrite.cli import main
from hfrewrite.emit.config_shim import shim_classes, shim_statements
from hfrewrite.errors import HfrewriteError
from hfrewrite.isolate.environment import NEWEST_4X, choose_version, ensure_overlay, overlay_dir

DATA = Path(__file__).parent / "data" / "custom_code"


@pytest.mark.parametrize(
    ("named", "requested", "version"),
    [
        ("4.57.1", None, "4.57.1"),  # the checkpoint's own release, new enough for the analysis
        ("4.32.0", None, NEWEST_4X),  # older than the analysis runs under: the newest 4.x
        ("5.2.0", None, NEWEST_4X),  # not a 4.x release
        (None, None, NEWEST_4X),
        ("4.32.0", "4.56.2", "4.56.2"),  # --analysis-transformers wins
    ],
)
def test_the_release_is_the_checkpoints_else_the_newest_4x(named, requested, version):
    data = {"transformers_version": named} if named else {}
    assert choose_version(data, requested)[0] == version


@pytest.mark.parametrize(
    ("requested", "message"), [("4.30.0", "4.56.0 or newer"), ("latest", "a 4.x release")]
)
def test_a_release_the_analysis_cannot_use_is_refused(requested, message):
    with pytest.raises(HfrewriteError, match=message):
        choose_version({}, requested)


def test_offline_with_an_empty_cache_names_the_release_and_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("HFREWRITE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HFREWRITE_OFFLINE", "1")
    with pytest.raises(HfrewriteError) as error:
        ensure_overlay("4.56.2")
    message = str(error.value)
    assert "transformers 4.56.2" in message and "hfrewrite setup-analysis 4.56.2" in message
    assert not (tmp_path / "cache").exists() or not overlay_dir("4.56.2").exists()


def test_convert_offline_without_the_release_fails_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HFREWRITE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HFREWRITE_OFFLINE", "1")
    repo = shutil.copytree(DATA / "transformers4" / "qwen", tmp_path / "qwen")
    code = main(
        [
            "convert",
            str(repo),
            "--trust-remote-code",
            "--analysis-transformers",
            "4.56.2",
            "-o",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "transformers 4.56.2" in err, err
    assert not (tmp_path / "out").exists()


def test_analysis_release_needs_trust_remote_code(tmp_path, capsys):
    code = main(["convert", "llama", "--analysis-transformers", NEWEST_4X, "-o", str(tmp_path / "out")])
    assert code == 2 and "needs --trust-remote-code" in capsys.readouterr().err


def _shim(name: str, config_class: str, model_type: str) -> type:
    path = DATA / "transformers4" / name / f"configuration_{name}.py"
    code = cst.Module(body=shim_statements(path, config_class, model_type)).code
    namespace: dict = {"__name__": f"shim_{name}"}
    exec(compile(code, str(path), "exec"), namespace)  # noqa: S102 - a test repository's class
    assert shim_classes(code) == {model_type: config_class}
    return namespace[config_class]


def test_the_shim_loads_internlm2s_config_as_its_class_wrote_it():
    # under transformers 5 the repository's own class reads `rope_scaling: null` back as the
    # standardised rope dict, which its validator rejects; the shim keeps it what 4.x kept
    shim = _shim("internlm2", "InternLM2Config", "internlm2")
    data = json.loads((DATA / "transformers4" / "internlm2" / "config.json").read_text())
    config = shim.from_dict(data)
    assert config.rope_scaling is None and config.model_type == "internlm2"
    assert config.num_key_value_heads == data["num_key_value_heads"] and config.bias == data["bias"]


def test_the_shim_carries_only_what_the_class_names():
    path = DATA / "transformers4" / "qwen" / "configuration_qwen.py"
    code = cst.Module(body=shim_statements(path, "QWenConfig", "qwen")).code
    assert [line for line in code.splitlines() if line.startswith("class ")] == [
        "class QWenConfig(PretrainedConfig):"
    ]
    assert "hfrewrite config shim" in code
    with pytest.raises(HfrewriteError, match="does not define NoSuchConfig"):
        shim_statements(path, "NoSuchConfig", "qwen")
