"""End-to-end fixtures: real vLLM on CPU, tiny checkpoints, stand-in model files.

Tests that run vLLM carry ``@pytest.mark.vllm``; they are skipped where vLLM is not
installed. vLLM itself runs in a ``hfrewrite.verify_worker`` subprocess, which
inherits the environment set here.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from hfrewrite.verify import vllm_env

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="vLLM is not installed")
    for item in items:
        if not HAVE_VLLM and item.get_closest_marker("vllm"):
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def vllm_environment(tmp_path_factory):
    """CPU-vLLM environment for the whole e2e session (inherited by workers)."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in vllm_env(tmp_path_factory.mktemp("vllm-cache")).items():
            mp.setenv(key, value)
        yield


def vllm_model_source(name: str) -> str:
    """Source of vLLM's own ``vllm/model_executor/models/<name>.py``, relative
    imports made absolute so the file works from anywhere."""
    spec = importlib.util.find_spec("vllm.model_executor.models")
    src = (Path(spec.submodule_search_locations[0]) / f"{name}.py").read_text()
    return re.sub(
        r"^(\s*)from \.(\w+) import", r"\1from vllm.model_executor.models.\2 import",
        src, flags=re.M,
    )


def write_standin(
    dst: Path, name: str = "llama", replace: dict[str, str] | None = None
) -> Path:
    """Write vLLM's ``<name>.py`` to ``dst`` as a stand-in generated file.

    ``replace`` maps exact source snippets to substitutes (each must occur) to make
    deliberately broken variants.
    """
    src = vllm_model_source(name)
    for old, new in (replace or {}).items():
        assert old in src, f"snippet not found in vLLM's {name}.py: {old!r}"
        src = src.replace(old, new)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(src)
    return dst
