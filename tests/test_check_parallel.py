"""check -j N: the same report as serial, file order kept, on the real pipeline."""

import shutil
from pathlib import Path

from hfrewrite.deliver.check import check_paths

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def test_parallel_report_equals_serial_with_drift(tmp_path):
    for name in ("llama.py", "qwen3.py", "mistral.py"):
        shutil.copy(GOLDEN / name, tmp_path / name)
    drifted = tmp_path / "qwen3.py"
    drifted.write_text(
        drifted.read_text().replace("class Qwen3MLP(nn.Module):", "class Qwen3MLP(nn.Module):  # edited")
    )
    parallel = check_paths([tmp_path], fix=False, jobs=2)
    serial = check_paths([tmp_path], fix=False, jobs=1)
    assert parallel.format() == serial.format()
    assert [r.status for r in parallel.results] == [
        "ok",
        "ok",
        "differs",
    ]  # sorted file order
    assert "+class Qwen3MLP(nn.Module):\n" in parallel.format()
