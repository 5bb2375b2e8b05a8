"""The CLI: convert output and refusal to clobber, check exit codes, verify wiring, bad input.

Bad input must give exactly one stderr line ``hfrewrite: error: ...``, exit code 2, and
leave the output directory untouched. The pipeline is a fake ``generate``.
"""

from __future__ import annotations

import importlib.machinery
import json
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub.constants
import pytest

from hfrewrite import convert
from hfrewrite.analyze.plan import NoMatch
from hfrewrite.cli import main
from hfrewrite.emit import output as emit

BODY = "# Copyright header kept from the source.\nimport torch\n\nX = 1\n"


def fake_generate(resolved):
    return SimpleNamespace(
        filename=f"{resolved.model_type}.py",
        text=emit.render(resolved, BODY),
        fused=(SimpleNamespace(module_class="LlamaAttention", fused="q+k+v -> QKVParallelLinear"),),
        declined=(NoMatch("fuse_gate_up", "LlamaMLP", "gate and up read different inputs"),),
    )


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """Fake pipeline, empty offline HF cache."""
    monkeypatch.setattr(convert, "generate", fake_generate)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_convert_writes_and_prints_table(tmp_path, capsys):
    out_dir = tmp_path / "out"
    code, out, err = run(capsys, "convert", "--no-verify", "llama", "-o", out_dir)
    assert (code, err) == (0, "")
    assert "LlamaAttention  q+k+v -> QKVParallelLinear" in out
    assert f"wrote {out_dir / 'llama.py'}" in out and "declined" not in out
    assert emit.parse_header((out_dir / "llama.py").read_text()).model == "llama"

    code, out, _ = run(capsys, "convert", "--no-verify", "llama", "-o", out_dir, "--explain")
    assert code == 0 and f"unchanged {out_dir / 'llama.py'}" in out
    assert "LlamaMLP      fuse_gate_up  gate and up read different inputs" in out


def test_convert_refuses_to_clobber_without_force(tmp_path, capsys, monkeypatch):
    target = tmp_path / "llama.py"
    target.write_text("hand written\n")
    # refused before the analysis: a file hfrewrite did not write is in the way
    monkeypatch.setattr(convert, "generate", lambda resolved: pytest.fail("analysed"))
    code, out, err = run(capsys, "convert", "--no-verify", "llama", "-o", tmp_path)
    assert code == 2 and out == ""
    assert (
        err
        == f"hfrewrite: error: {target} exists and is not a file hfrewrite wrote; use --force to overwrite it\n"
    )
    assert target.read_text() == "hand written\n"
    monkeypatch.setattr(convert, "generate", fake_generate)
    assert run(capsys, "convert", "--no-verify", "llama", "-o", tmp_path, "--force")[0] == 0
    assert emit.parse_header(target.read_text()) is not None
    # one generated from another model: refused before the analysis too
    target.rename(tmp_path / "qwen3.py")
    monkeypatch.setattr(convert, "generate", lambda resolved: pytest.fail("analysed"))
    code, _, err = run(capsys, "convert", "--no-verify", "qwen3", "-o", tmp_path)
    assert code == 2 and "qwen3.py exists, generated from llama, not qwen3; use --force" in err
    # one hfrewrite generated from this model, but with other text: known once regenerated
    (tmp_path / "llama.py").write_text((tmp_path / "qwen3.py").read_text() + "# edited\n")
    monkeypatch.setattr(convert, "generate", fake_generate)
    code, _, err = run(capsys, "convert", "--no-verify", "llama", "-o", tmp_path)
    assert code == 2 and "llama.py exists and differs; use --force to overwrite it" in err


def bad_dir_missing(tmp_path):
    (tmp_path / "m").mkdir()
    return tmp_path / "m", "no config.json in"


def bad_dir_malformed(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{not json")
    return tmp_path / "m", "config.json is not valid JSON"


def bad_auto_map(tmp_path):
    (tmp_path / "m").mkdir()
    cfg = {"model_type": "llama", "auto_map": {"AutoModel": "modeling_x.X"}}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    return tmp_path / "m", "refusing without --trust-remote-code"


def bad_unknown_type(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "frobnicator"}')
    return tmp_path / "m", "unknown model type 'frobnicator'"


def bad_unknown_id(tmp_path):
    return "org/not-cached", "not in the local Hugging Face cache"


def bad_unknown_name(tmp_path):
    return "notamodel", "not in the local Hugging Face cache"


@pytest.mark.parametrize(
    "case",
    [
        bad_dir_missing,
        bad_dir_malformed,
        bad_auto_map,
        bad_unknown_type,
        bad_unknown_id,
        bad_unknown_name,
    ],
)
def test_bad_input_one_line_exit_2_nothing_written(case, tmp_path, capsys):
    model, message = case(tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, out, err = run(capsys, "convert", "--no-verify", model, "-o", out_dir)
    assert code == 2 and out == ""
    assert err.startswith("hfrewrite: error: ") and err.count("\n") == 1
    assert message in err
    assert list(out_dir.iterdir()) == []


def test_check_exit_codes(tmp_path, capsys):
    golden = tmp_path / "golden"
    assert run(capsys, "convert", "--no-verify", "llama", "-o", golden)[0] == 0
    assert run(capsys, "check", golden)[0] == 0

    f = golden / "llama.py"
    f.write_text(f.read_text().replace("X = 1", "X = 3"))
    code, out, _ = run(capsys, "check", golden)
    assert code == 1 and "+X = 1" in out and f"hfrewrite check {golden} --fix" in out

    assert run(capsys, "check", golden, "--fix")[0] == 0
    assert run(capsys, "check", golden)[0] == 0


def test_verify_is_wired_lazily(monkeypatch, capsys):
    calls = []
    fake = types.ModuleType("hfrewrite.verify.command")
    fake.__spec__ = importlib.machinery.ModuleSpec("hfrewrite.verify.command", None)
    fake.main = lambda args: calls.append((args.model_type, args.generated)) or 0
    monkeypatch.setitem(sys.modules, "hfrewrite.verify.command", fake)
    assert run(capsys, "verify", "qwen3", "--generated", "g/qwen3.py")[0] == 0
    assert calls == [("qwen3", Path("g/qwen3.py"))]


def test_no_command_prints_help(capsys):
    code, _, err = run(capsys)
    assert code == 2 and "convert" in err


def test_console_script_bad_input(tmp_path):
    """The installed entry point: one stderr line, exit code 2."""
    (tmp_path / "m").mkdir()
    exe = Path(sys.executable).with_name("hfrewrite")
    proc = subprocess.run(
        [
            str(exe),
            "convert",
            "--no-verify",
            str(tmp_path / "m"),
            "-o",
            str(tmp_path / "out"),
        ],
        check=False,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"hfrewrite: error: no config.json in {tmp_path / 'm'}\n"
    assert not (tmp_path / "out").exists()


def test_verify_takes_a_checkpoint_directory(monkeypatch, capsys, tmp_path):
    calls = []
    fake = types.ModuleType("hfrewrite.verify.checkpoint")
    fake.__spec__ = importlib.machinery.ModuleSpec("hfrewrite.verify.checkpoint", None)
    fake.main = lambda args: calls.append((args.model_type, args.dtype, args.max_tokens)) or 0
    monkeypatch.setitem(sys.modules, "hfrewrite.verify.checkpoint", fake)
    (tmp_path / "config.json").write_text("{}")
    assert run(capsys, "verify", tmp_path, "--dtype", "bfloat16")[0] == 0
    assert calls == [(str(tmp_path), "bfloat16", 16)]


def test_an_interrupt_reported_as_a_refusal_is_still_an_interrupt(monkeypatch, capsys):
    """torch re-raises an exception raised inside its calls as a RuntimeError, which the
    analysis may turn into a refusal: after Ctrl-C or SIGTERM, exit 130, not 2."""
    import signal

    from hfrewrite import cli
    from hfrewrite.errors import HfrewriteError

    def interrupted_inside_torch(args):
        try:
            cli._interrupt(signal.SIGTERM, None)
        except KeyboardInterrupt as exc:
            raise HfrewriteError("llama: trace: RuntimeError: KeyboardInterrupt") from exc

    monkeypatch.setattr(cli, "_convert", interrupted_inside_torch)
    assert cli.main(["convert", "llama", "-o", "unused"]) == 130
    assert capsys.readouterr().err == "hfrewrite: error: interrupted\n"
    monkeypatch.setattr(cli, "_convert", lambda args: (_ for _ in ()).throw(HfrewriteError("refused")))
    assert cli.main(["convert", "llama", "-o", "unused"]) == 2  # a later run starts clean
