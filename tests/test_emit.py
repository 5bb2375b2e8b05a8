"""emit: header round trip, canonical formatting, determinism, atomic write and --force."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hfrewrite import __version__
from hfrewrite.emit import cst_tools
from hfrewrite.emit import output as emit
from hfrewrite.errors import HfrewriteError

LICENSE = "# coding=utf-8\n# Copyright 2024 The HuggingFace Team. All rights reserved.\n"
BODY = LICENSE + (
    '"""Doc."""\nimport torch\nfrom torch import nn\nimport os\n'
    "x = {'b': 2, 'a': 1}\nclass A(nn.Module):\n  pass\nY = (os.sep, torch.float32)\n"
)


def fake_resolved(model_id="llama", kind="type", revision=None, trust=False):
    """What emit reads of a ResolvedModel (no transformers import needed)."""
    return SimpleNamespace(
        model_id=model_id,
        source_kind=kind,
        revision=revision,
        model_type="llama",
        modeling_module="transformers.models.llama.modeling_llama",
        transformers_version="5.19.0",
        trust_remote_code=trust,
    )


def test_header_names_source_and_round_trips():
    r = fake_resolved()
    h = emit.header(r)
    assert "transformers/models/llama/modeling_llama.py (transformers 5.19.0)" in h
    assert f"hfrewrite {__version__}" in h
    assert "# Regenerate: hfrewrite convert llama -o <dir> --force\n" in h
    assert (  # the record cut to vLLM's width after a comma, continued at "#     "
        '# hfrewrite-source: {"hfrewrite": "0.1.0", "model": "llama", "revision": null,\n'
        '#     "transformers": "5.19.0"}\n' in h
    )
    assert emit.parse_header(h + "\nimport torch\n") == emit.record_for(r)
    assert max(len(line) for line in h.splitlines()) <= 88
    assert h.splitlines()[1] == "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project"


def test_a_long_record_is_cut_on_several_lines_and_read_back():
    record = emit.SourceRecord(
        model="/some/long/directory/with, a comma/and spaces in it/checkpoints/my-model",
        revision=None,
        transformers="5.19.0",
        hfrewrite="0.1.0",
        trust_remote_code=True,
        analysis_transformers="4.57.3",
    )
    lines = record.to_lines().splitlines()
    assert len(lines) > 2 and all(line.startswith("#     ") for line in lines[1:])
    assert emit.parse_header("\n".join(lines) + "\n\nimport torch\n") == record


def test_header_with_revision_and_remote_code_round_trips():
    r = fake_resolved("org/my model", "hub", revision="v1", trust=True)
    h = emit.header(r)
    assert "hfrewrite convert 'org/my model' --revision v1 --trust-remote-code" in h
    rec = emit.parse_header(h)
    assert (rec.model, rec.revision, rec.trust_remote_code) == (
        "org/my model",
        "v1",
        True,
    )


def test_header_has_no_machine_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    h = emit.header(fake_resolved("./ckpt", "dir"))
    assert "./ckpt (local directory)" in h and str(tmp_path) not in h


def test_parse_header_absent_or_malformed():
    assert emit.parse_header("import torch\n# hfrewrite-source: {}\n") is None
    with pytest.raises(HfrewriteError, match="malformed hfrewrite-source"):
        emit.parse_header("# hfrewrite-source: {not json\n")


def test_render_formats_with_header_then_license():
    out = emit.render(fake_resolved(), BODY)
    h = emit.header(fake_resolved())
    assert out.startswith(h + "\n" + LICENSE)
    assert "import os\n\nimport torch\nfrom torch import nn\n" in out  # sorted
    assert 'x = {"b": 2, "a": 1}\n' in out and "    pass\n" in out  # formatted
    assert emit.render(fake_resolved(), out[len(h) :]) == out  # canonical: a fixed point


def test_render_drops_unused_imports():
    out = emit.render(fake_resolved(), "import os\nimport torch\n\nX = torch.float32\n")
    assert "import os" not in out and "import torch\n" in out


def test_render_refuses_code_that_does_not_parse():
    with pytest.raises(HfrewriteError, match="does not parse before formatting.*line 10: .def f"):
        emit.render(fake_resolved(), "def f(:\n    pass\n")


RENDER_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from test_emit import BODY, fake_resolved
from hfrewrite.emit.output import render
sys.stdout.write(render(fake_resolved(), BODY))
"""


def test_render_is_byte_identical_across_hash_seeds():
    script = RENDER_SCRIPT.format(tests=str(Path(__file__).parent))
    outs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, env=env, check=True)
        outs.append(proc.stdout)
    assert outs[0] == outs[1]
    assert outs[0].decode() == emit.render(fake_resolved(), BODY)


def test_write_atomic_new_same_and_different(tmp_path):
    target = tmp_path / "out" / "llama.py"
    assert emit.write_atomic(target, "a = 1\n", force=False) == "written"
    assert target.read_text() == "a = 1\n"
    mtime = target.stat().st_mtime_ns
    assert emit.write_atomic(target, "a = 1\n", force=False) == "unchanged"
    assert target.stat().st_mtime_ns == mtime
    with pytest.raises(HfrewriteError, match="exists and differs; use --force"):
        emit.write_atomic(target, "a = 2\n", force=False)
    assert target.read_text() == "a = 1\n"
    assert emit.write_atomic(target, "a = 2\n", force=True) == "written"
    assert target.read_text() == "a = 2\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["llama.py"]  # no temp left


def test_resolved_self_follows_init_expressions():
    t = cst_tools
    exprs = {"hidden_dim": "config.hidden_size", "ffn": "self.hidden_dim * 4", "n": "config.n"}
    assert (
        t.resolved_self("nn.Linear(self.ffn, self.n)", exprs)
        == "nn.Linear((config.hidden_size * 4), config.n)"
    )
    assert t.resolved_self("self.unknown + 1", exprs) == "self.unknown + 1"  # left for the caller to refuse


def test_a_long_regenerate_command_goes_on_indented():
    r = fake_resolved()
    r.model_id = "a-rather-long-organisation/a-model-whose-name-fills-the-line"
    lines = emit.header(r).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("# Regenerate: "))
    assert lines[at + 1].startswith("#   ") and "--force" in lines[at + 1], lines[at : at + 2]
    assert lines[at + 2].startswith("#   or in place")
