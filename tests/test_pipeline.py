"""The pass registry: every file in passes/ is registered once, in one order, under a unique name."""

from pathlib import Path

from hfrewrite.emit.passes_doc import render
from hfrewrite.emit.pipeline import PASSES, describe

PASSES_DIR = Path(__file__).resolve().parents[1] / "passes"


def test_every_pass_file_is_registered_once():
    files = sorted(p.stem for p in PASSES_DIR.glob("*.py") if p.stem != "__init__")
    registered = [Path(p.__file__).stem for p in PASSES]
    assert sorted(registered) == files
    assert len(set(registered)) == len(registered)


def test_pass_names_are_unique_and_match_their_files():
    names = [p.NAME for p in PASSES]
    assert len(set(names)) == len(names)
    assert names == [Path(p.__file__).stem for p in PASSES]


def test_every_pass_documents_pattern_and_output():
    for p in PASSES:
        doc = p.__doc__ or ""
        assert describe(p), p.NAME
        assert "Matches" in doc and ("Emits" in doc or "Emit" in doc) and "Preconditions" in doc, p.NAME


def test_docs_passes_page_is_generated_from_the_docstrings():
    doc = (PASSES_DIR.parent / "docs" / "passes.md").read_text()
    assert doc == render(), "docs/passes.md is stale: run `make docs`"
    headings = [line.split("`")[1] for line in doc.splitlines() if line.startswith("## ")]
    assert headings == [p.NAME for p in PASSES]
