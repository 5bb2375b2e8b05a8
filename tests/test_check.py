"""check: up to date -> 0; hand-edited -> 1 with a diff and the update command; --fix -> 0.

The pipeline is replaced by a fake ``generate`` that renders a fixed body, so these tests
exercise regenerate-and-diff, not the rewrite passes.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from hfrewrite import convert
from hfrewrite.deliver.check import check_paths
from hfrewrite.emit import output as emit
from hfrewrite.errors import HfrewriteError

BODY = "# Copyright header kept from the source.\nimport torch\n\nX = 1\n"


def fake_generate(resolved):
    return SimpleNamespace(
        filename=f"{resolved.model_type}.py",
        text=emit.render(resolved, BODY),
        fused=(),
        declined=(),
    )


@pytest.fixture
def golden(tmp_path, monkeypatch):
    """A golden dir holding one file generated (by the fake pipeline) for `llama`."""
    monkeypatch.setattr(convert, "generate", fake_generate)
    from hfrewrite.resolve import resolve

    d = tmp_path / "golden"
    d.mkdir()
    (d / "llama.py").write_text(fake_generate(resolve("llama")).text)
    (d / "helper.py").write_text("print('not generated')\n")  # skipped: no header
    return d


def test_up_to_date_exits_zero(golden):
    report = check_paths([golden], fix=False)
    assert report.exit_code == 0
    assert [r.status for r in report.results] == ["ok"]
    assert report.skipped == (golden / "helper.py",)
    assert "all 1 generated file(s) up to date" in report.format()


def test_hand_edit_is_reported_then_fixed(golden):
    f = golden / "llama.py"
    good = f.read_text()
    f.write_text(good.replace("X = 1", "X = 2"))

    report = check_paths([golden], fix=False)
    text = report.format()
    assert report.exit_code == 1
    assert f"--- {f} (on disk)\n+++ {f} (regenerated)\n" in text
    assert "-X = 2\n+X = 1" in text
    assert f"Update them with: hfrewrite check {golden} --fix" in text
    assert "X = 2" in f.read_text()  # check alone never writes

    report = check_paths([golden], fix=True)
    assert report.exit_code == 0 and report.results[0].status == "fixed"
    assert f.read_text() == good
    assert check_paths([golden], fix=False).exit_code == 0


def test_transformers_version_drift_is_named(golden):
    f = golden / "llama.py"
    f.write_text(f.read_text().replace('"transformers": "5.19.0"', '"transformers": "5.0.0"'))
    text = check_paths([f], fix=False).format()
    assert "generated with transformers 5.0.0; installed is 5.19.0" in text


def test_no_generated_files_is_an_error(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(HfrewriteError, match="no hfrewrite-generated .py files"):
        check_paths([tmp_path], fix=False)
    with pytest.raises(HfrewriteError, match="no such file or directory"):
        check_paths([tmp_path / "missing"], fix=False)


GOLDEN = Path(__file__).resolve().parent.parent / "golden"


@pytest.mark.slow  # 75-115 s on 2 cores: `hfrewrite check golden/ -j 2` is the edit loop's form
def test_golden_files_are_up_to_date():
    """The real pipeline regenerates every file in golden/ byte for byte (CI runs this)."""
    report = check_paths([GOLDEN], fix=False, jobs=os.cpu_count() or 1)
    assert {r.path.name for r in report.results} >= {
        "llama.py",
        "mistral.py",
        "qwen2.py",
        "qwen3.py",
    }
    assert report.exit_code == 0, report.format().replace(str(GOLDEN), "golden")
