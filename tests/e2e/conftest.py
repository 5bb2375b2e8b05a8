"""End-to-end fixtures: real vLLM on CPU, tiny checkpoints, stand-in model files.

Tests that run vLLM carry ``@pytest.mark.vllm``; they are skipped where vLLM is not
installed (``make test`` sets ``HFREWRITE_REQUIRE_VLLM=1``, so there a missing vLLM is an
error, not a skip). vLLM itself runs in a ``hfrewrite.verify.worker`` subprocess, which
inherits the environment set here. Stand-in model files: ``fixtures.write_vllm_standin``.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from hfrewrite.verify.engine import vllm_env

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config, items):
    if not HAVE_VLLM and os.environ.get("HFREWRITE_REQUIRE_VLLM") == "1":
        raise pytest.UsageError("HFREWRITE_REQUIRE_VLLM=1 but vLLM is not installed (make setup)")
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
