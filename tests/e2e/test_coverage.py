"""Every causal-LM model type of the installed transformers converts or is refused in one
line (exit 2, no traceback), and docs/coverage.md is what the sweep renders now."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hfrewrite import coverage

DOC = Path(__file__).resolve().parents[2] / "docs" / "coverage.md"


@pytest.fixture(scope="module")
def results(monkeypatch_module):
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    return coverage.sweep(coverage.model_types(), jobs=2)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_every_type_converts_or_is_refused_in_one_line(results):
    unclean = {r["type"]: r["reason"] for r in results if r["outcome"] == coverage.NOT_CLEAN}
    assert unclean == {}
    refused = [r for r in results if r["outcome"] == coverage.REFUSED]
    assert all(r["reason"] and "\n" not in r["reason"] for r in refused)


def test_every_golden_type_converts(results):
    outcome = {r["type"]: r["outcome"] for r in results}
    types = coverage.goldens_of_types()
    assert {t: outcome.get(t) for t in types if outcome.get(t) != coverage.CONVERTS} == {}


def test_the_coverage_doc_is_the_sweep_rendered(results):
    text = coverage.render(results, coverage.vllm_native_archs(), coverage.goldens())
    # (a replay's measured difference may round otherwise on another CPU)
    numbers = lambda doc: re.sub(r"\d+\.\d+(e[+-]\d+)?", "<number>", doc)
    assert numbers(DOC.read_text()) == numbers(text), "docs/coverage.md is stale: run `make coverage`"
