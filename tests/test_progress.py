"""convert's progress lines: on a terminal only, on stderr, one per slow step (the real pipeline)."""

from hfrewrite.cli import main


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_progress_on_a_terminal_only(tmp_path, capsys, monkeypatch):
    # Not a terminal (pytest captures stderr): quiet, as in CI.
    monkeypatch.delenv("HFREWRITE_PROGRESS", raising=False)
    code, _, err = run(capsys, "convert", "--no-verify", "llama", "-o", tmp_path / "a")
    assert (code, err) == (0, "")
    # Forced on (what a terminal gets): one line per slow step, on stderr; stdout unchanged.
    monkeypatch.setenv("HFREWRITE_PROGRESS", "1")
    code, out, err = run(capsys, "convert", "--no-verify", "llama", "-o", tmp_path / "b")
    assert code == 0 and "LlamaAttention     q_proj+k_proj+v_proj -> QKVParallelLinear" in out
    lines = err.splitlines()
    assert [line.split(" ...")[0] for line in lines] == [
        "hfrewrite: resolving llama",  # the first line comes before transformers loads
        "hfrewrite: loading torch",
        "hfrewrite: building and tracing a shrunk copy, proving replacements",
        "hfrewrite: rewriting modeling_llama.py",
        "hfrewrite: formatting",
    ]
    assert all(line.endswith(" s)") and " done (" in line for line in lines)
