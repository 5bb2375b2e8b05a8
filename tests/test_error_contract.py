"""The CLI's error contract, end to end in real processes: bad destinations and
unreachable Hubs fail fast with one line and exit 2; interrupts (SIGINT, SIGTERM) during the
analysis or the write leave no file behind, partial or temporary; two converts racing into
one directory leave one valid file.

(The table of bad model inputs is in test_cli.py; refusals of real models in
test_refusals.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HFREWRITE = Path(sys.executable).with_name("hfrewrite")


@pytest.fixture(autouse=True)
def _interruptible():
    """A suite started in the background (`make test &`) has SIGINT ignored, which children
    inherit; with a handler here instead, they start with Ctrl-C's default, as in a terminal."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def convert(*argv, env=None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [str(HFREWRITE), "convert", "--no-verify", *map(str, argv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        **kwargs,
    )


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def one_error_line(err: str, message: str) -> None:
    assert err.startswith("hfrewrite: error: ") and err.count("\n") == 1, err
    assert message in err, err


def bad_output_file(tmp_path):
    (tmp_path / "file").write_text("x")
    return tmp_path / "file", "is a file; give a directory"


def bad_output_under_file(tmp_path):
    (tmp_path / "file").write_text("x")
    return tmp_path / "file" / "sub", "lies under the file"


def bad_output_unwritable(tmp_path):
    # /proc takes no new entries, even for root (access checks would pass for root)
    return Path("/proc/hfrewrite-test/out"), "cannot write in /proc"


@pytest.mark.parametrize("case", [bad_output_file, bad_output_under_file, bad_output_unwritable])
def test_bad_destination_fails_before_the_analysis(case, tmp_path):
    out, message = case(tmp_path)
    start = time.perf_counter()
    code, stdout, err = finish(convert("llama", "-o", out))
    assert code == 2 and stdout == ""
    one_error_line(err, message)
    assert time.perf_counter() - start < 6  # the analysis (about 7 s) never started
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["file"])


def test_unreachable_hub_fails_fast_and_says_so(tmp_path):
    # a Hub endpoint nothing listens on (no network needed): refused at once, no retries
    env = {
        "HF_HUB_OFFLINE": "0",
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "HF_HOME": str(tmp_path / "hf"),
    }
    start = time.perf_counter()
    code, stdout, err = finish(convert("org/not-a-model", "-o", tmp_path / "out", env=env))
    assert code == 2 and stdout == ""
    one_error_line(err, "the Hub is unreachable (cannot connect to 127.0.0.1:9")
    assert time.perf_counter() - start < 15
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_during_the_analysis_writes_nothing(sig, tmp_path):
    out = tmp_path / "out"
    proc = convert("llama", "-o", out, env={"HFREWRITE_PROGRESS": "1"})
    started = _read_until(proc, "building and tracing a shrunk copy")  # the analysis is running
    proc.send_signal(sig)
    code, _, err = finish(proc)
    assert code == 130
    shown = (started + err).splitlines()  # the steps before it done, its line "failed", the one error
    assert all(" ... done (" in line for line in shown[:-2]), shown
    assert shown[-2].endswith("failed") and shown[-1] == "hfrewrite: error: interrupted", shown
    assert shown[-2].startswith("hfrewrite: building and tracing a shrunk copy"), shown
    assert not out.exists() or list(out.iterdir()) == []


def _read_until(proc: subprocess.Popen, text: str, timeout: float = 60) -> str:
    """stderr of ``proc`` read until ``text`` appears (on any machine speed)."""
    seen, deadline = "", time.monotonic() + timeout
    while text not in seen:
        assert time.monotonic() < deadline and proc.poll() is None, seen
        seen += os.read(proc.stderr.fileno(), 64).decode()
    return seen


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_during_the_write_leaves_no_temporary_file(sig, tmp_path):
    # the write is made slow by a file system that fsyncs slowly: a sitecustomize hook
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, time\n"
        "_fsync = os.fsync\n"
        "def fsync(fd):\n"
        "    open(os.environ['HFREWRITE_TEST_MARK'], 'w').close()\n"
        "    time.sleep(30)\n"
        "    _fsync(fd)\n"
        "os.fsync = fsync\n"
    )
    mark, out = tmp_path / "writing", tmp_path / "out"
    env = {"PYTHONPATH": str(hook), "HFREWRITE_TEST_MARK": str(mark)}
    proc = convert("llama", "-o", out, env=env)
    deadline = time.monotonic() + 120
    while not mark.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    assert next(p.name for p in out.iterdir()).endswith(".tmp")  # mid-write
    proc.send_signal(sig)
    code, _, err = finish(proc)
    assert code == 130
    one_error_line(err, "interrupted")
    assert list(out.iterdir()) == []


def test_concurrent_converts_into_one_directory_leave_one_valid_file(tmp_path):
    out = tmp_path / "out"
    procs = [convert("llama", "-o", out) for _ in range(2)]
    results = [finish(p) for p in procs]
    assert [code for code, _, _ in results] == [0, 0], [err for _, _, err in results]
    assert [p.name for p in out.iterdir()] == ["llama.py"]
    text = (out / "llama.py").read_text()
    compile(text, "llama.py", "exec")
    assert text == (Path(__file__).parents[1] / "golden" / "llama.py").read_text()
