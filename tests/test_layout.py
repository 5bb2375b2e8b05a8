"""The tree shows the stages: the folders of hfrewrite/ are the boxes of docs/pipeline.md's
diagram, in order, and no module grows past a reviewable size."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500


def _diagram() -> str:
    text = (ROOT / "docs" / "pipeline.md").read_text()
    return re.search(r"```\n(.*?)```", text, re.DOTALL)[1]


def test_the_pipeline_diagram_names_every_stage_folder_once_in_order():
    folders = sorted(p.name for p in (ROOT / "hfrewrite").iterdir() if (p / "__init__.py").is_file())
    boxes = re.findall(r"^ (hfrewrite/\w+)/", _diagram(), re.MULTILINE)
    assert sorted(b.split("/")[1] for b in boxes) == folders
    assert boxes == [
        "hfrewrite/isolate",
        "hfrewrite/analyze",
        "hfrewrite/emit",
        "hfrewrite/verify",
        "hfrewrite/deliver",
    ]


def test_the_diagram_names_only_files_that_exist():
    diagram = _diagram()
    named = set(re.findall(r"\b([a-z_]+\.py)\b", diagram))
    existing = {p.name for p in (ROOT / "hfrewrite").rglob("*.py")}
    assert named and named <= existing | {"modeling_<type>.py"}


def test_no_module_of_the_compiler_is_over_the_size_limit():
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for folder in ("hfrewrite", "passes", "templates")
        for p in (ROOT / folder).rglob("*.py")
    }
    assert {f: n for f, n in sizes.items() if n > MAX_LINES} == {}


MAX_FUNCTION_LINES = 60


def test_no_function_of_the_passes_or_the_analysis_is_over_60_lines():
    """A pass or an analysis step reads at one sitting: long functions are split into named steps."""
    import ast

    long = {
        f"{p.relative_to(ROOT)}:{node.lineno} {node.name}": node.end_lineno - node.lineno + 1
        for folder in ("passes", "hfrewrite/analyze")
        for p in (ROOT / folder).rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    }
    assert long == {}


def test_no_two_test_files_share_a_name():
    """pytest imports test files by their base name (no packages under tests/): two files of one
    name in different folders stop the whole run at collection."""
    from collections import Counter

    names = Counter(p.name for p in (ROOT / "tests").rglob("test_*.py"))
    assert {n: c for n, c in names.items() if c > 1} == {}
