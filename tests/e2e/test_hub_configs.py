"""Each golden file on the released configs of its architecture (tests/data/hub_configs): in
real vLLM against Hugging Face, on a shrunk copy of each released config.json (every switch
kept). ``hfrewrite check golden/`` (tests/test_check.py) proves the goldens are what convert
writes, so this runs the checked-in files themselves.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TYPES = sorted(p.name for p in (ROOT / "tests" / "data" / "hub_configs").iterdir() if p.is_dir())


def _matrix():
    spec = importlib.util.spec_from_file_location(
        "config_matrix", ROOT / "tests" / "tools" / "config_matrix.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.vllm
@pytest.mark.parametrize("model_type", TYPES)
def test_golden_validates_on_every_released_config(model_type):
    result = _matrix().validate_golden(model_type)
    print(f"\n{model_type}: {result['validated']}/{len(result['configs'])} ({result['seconds']:.0f} s)")
    assert len(result["configs"]) >= 1
    assert result["failed"] == [], result["failed"]
