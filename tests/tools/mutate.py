"""Mutation testing of the compiler (``make mutate``): cosmic-ray mutates one place of
``passes/`` (or ``hfrewrite/analyze/``) at a time, on disk, and runs that part's fast tests
against it, then regenerates a sample of golden/; a mutant that fails neither "survived".
Mutants inside type annotations cannot change behaviour and are not counted, nor are the
survivors read and judged equivalent (``EQUIVALENT``, each with its reason, listed in the
report). ``--sample N`` keeps a seeded random sample of each target's mutants (all of them
take hours on 2 cores). Writes the score and the survivors to ``--out`` (JSON).

    python tests/tools/mutate.py --sample 200 --seed 1 --out docs/mutation.json
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# A mutant is killed by the target's fast tests or, when those pass, by a regenerated golden
# file that differs (a sample of golden/ that spans the passes: about 20 s).
GOLDEN_SAMPLE = [
    "llama",
    "qwen3_moe",
    "qwen2_moe",
    "gemma2",
    "gemma3_text",
    "phi3",
    "gpt_neox",
    "persimmon",
    "granite",
    "smollm3",
    "nanochat",
]
CONFIG = """\
[cosmic-ray]
module-path = ["{module}"]
timeout = 120.0
excluded-modules = []
test-command = "{python} {script} --test '{tests}'"

[cosmic-ray.distributor]
name = "local"
"""

# Survivors read and judged equivalent: the mutant computes what the original does on every
# input the code can receive. Keyed by (file, operator, the original line); not counted in the
# score, and listed with the reason in the report.
EQUIVALENT = {
    (
        "hfrewrite/analyze/routing.py",
        "ReplaceComparisonOperator_Eq_Is",
        'if not (isinstance(weight, Node) and weight.op == "get_attr"):',
    ): "fx node ops are interned string constants: identity is equality",
    (
        "hfrewrite/analyze/routing.py",
        "ReplaceComparisonOperator_Eq_GtE",
        'if not (isinstance(weight, Node) and weight.op == "get_attr"):',
    ): "the ops sorting after get_attr are placeholder and output; an F.linear weight inside the MoE block "
    "is never the output node, and a placeholder would be a decoder-layer input, which no router weight is",
    (
        "hfrewrite/analyze/routing.py",
        "ReplaceUnaryOperator_USub_UAdd",
        "w, idx = torch.topk(torch.softmax(logits, dim=-1), facts.top_k, dim=-1)",
    ): "route() receives the flattened [tokens, experts] logits: dim 1 is dim -1",
    (
        "passes/fuse_qkv.py",
        "ReplaceComparisonOperator_Eq_Is",
        "if i == first:",
    ): "statement indices: CPython keeps one object per small int, so `is` equals `==` below 257 statements",
    (
        "passes/vllm_attention.py",
        "ReplaceBinaryOperator_Add_BitXor",
        "states = _state_names(body[split_at + 1 :])",
    ): "for an odd index the slice also holds the statement before the split, which cannot read q/k/v "
    "(fuse_qkv refuses a forward that uses those names), so the name map is the same",
    (
        "passes/thread_layer_args.py",
        "NumberReplacer",
        "extra = [a for a in self.needs[self.cls[-1]] if a not in have]",
    ): "differs only inside a nested class that has the name of a top-level class; the guard above reads "
    "self.cls[-1] unmutated",
    (
        "passes/fuse_qkv.py",
        "NumberReplacer",
        "if any(len(c) != 1 for c in calls.values()) or len({c[0] for c in calls.values()}) != 1:",
    ): "the first clause leaves one call per role, so c[-1] is c[0]",
    (
        "passes/vllm_attention.py",
        "NumberReplacer",
        "isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 and isinstance(s.body[0], cst.Assign)",
    ): "the clause before leaves one statement on the line, so body[-1] is body[0]",
    (
        "hfrewrite/analyze/model.py",
        "NumberReplacer",
        "layer = traces[lead].module",
    ): "_compare_layers has proven every traced layer's decoder plan alike (the same norm attributes), so the "
    "last layer's norms are of the first's classes; the norm facts come from the classes' formulas",
    (
        "hfrewrite/analyze/attention.py",
        "ReplaceComparisonOperator_Eq_IsNot",
        "if not any(torch.is_tensor(v) and any(v.shape == lv.shape and torch.equal(v, lv)",
    ): "torch.equal is False for tensors of different shapes",
    (
        "hfrewrite/analyze/attention.py",
        "ReplaceComparisonOperator_Eq_GtE",
        'ok = ((n.op == "call_method" and n.target in _LAYOUT_METHODS)',
    ): "the other ops it lets through have submodule paths or argument names as targets, never a tensor method name",
    (
        "hfrewrite/analyze/mlp.py",
        "ReplaceComparisonOperator_Is_Eq",
        "if isinstance(val, str) and val in ACT2FN and type(ACT2FN[val]) is type(module):",
    ): "classes compare by identity",
    (
        "hfrewrite/analyze/layer_agreement.py",
        "ReplaceComparisonOperator_NotEq_IsNot",
        "rope_layers=RopeLayers.SOME if roped and len(roped) != len(plans) else chosen.rope_layers,",
    ): "layer counts: CPython keeps one object per small int",
    (
        "hfrewrite/analyze/moe.py",
        "ReplaceComparisonOperator_NotEq_IsNot",
        'if scoring != "softmax":',
    ): '_scoring returns the constant "softmax" itself for a softmax; anything else differs from it either way',
    (
        "hfrewrite/analyze/attention.py",
        "ReplaceComparisonOperator_Eq_GtE",
        'if n.op == "call_module" and n.target in {f"{path}.{norms[r]}" for r in "qk"}',
    ): "the other ops it lets through (placeholder, output, get_attr) never have a submodule path as target",
    (
        "hfrewrite/analyze/attention.py",
        "ReplaceComparisonOperator_NotEq_Is",
        "if got.shape != want.shape or not torch.equal(got, want):",
    ): "torch.equal is False for tensors of different shapes",
    (
        "hfrewrite/analyze/attention.py",
        "NumberReplacer",
        "if len(found) != 1 or found[0] not in group:",
    ): "the first clause leaves one element, so found[-1] is found[0]",
    (
        "hfrewrite/analyze/mlp.py",
        "NumberReplacer",
        "product = down.args[0]",
    ): "a call of an nn.Linear module has one argument",
    (
        "hfrewrite/analyze/mlp.py",
        "NumberReplacer",
        "and act.args[0] in linears",
    ): "the clause before requires exactly one argument",
    (
        "hfrewrite/analyze/moe.py",
        "ReplaceComparisonOperator_Eq_Is",
        'if u.op == "call_method" and u.target in ("view", "reshape"):',
    ): "fx node ops are interned string constants, as is the literal: identity is equality",
    (
        "hfrewrite/analyze/rope.py",
        "NumberReplacer",
        "positions = torch.arange(values[0][0].shape[2])",
    ): "the loop above returned unless input and output have the same shape",
    (
        "hfrewrite/analyze/model.py",
        "NumberReplacer",
        "chosen = roped[0] if roped else plans[0]",
    ): "with no roped layer vllm_attention refuses the model, and layers that agree on everything but "
    "windows give the same plan (the window is taken from plans[0] on the next line)",
}


def _equivalence(mutant: dict) -> str | None:
    removed = next((c[1:].strip() for c in mutant["change"] if c.startswith("-")), "")
    return EQUIVALENT.get((mutant["file"], mutant["operator"], removed))


def _split_equivalent(survivors: list[dict]) -> tuple[list[dict], list[dict]]:
    """(survivors, equivalent mutants with the reason)."""
    judged = [(m, _equivalence(m)) for m in survivors]
    return [m for m, why in judged if not why], [{**m, "equivalent": why} for m, why in judged if why]


def mutate(module: str, tests: str, sample: int, seed: int) -> dict:
    """Run a seeded sample of the mutants of ``module`` against ``tests``; the outcome counts."""
    cosmic = [str(Path(sys.executable).with_name("cosmic-ray"))]
    with tempfile.TemporaryDirectory(prefix="hfrewrite-mutate-") as tmp:
        config, session = Path(tmp) / "config.toml", Path(tmp) / "session.sqlite"
        config.write_text(
            CONFIG.format(
                module=module,
                python=sys.executable,
                script=Path(__file__).resolve(),
                tests=tests,
            )
        )
        subprocess.run([*cosmic, "init", str(config), str(session)], cwd=REPO, check=True)
        db = sqlite3.connect(session)
        specs = db.execute(
            "select job_id, module_path, start_pos_row, start_pos_col from mutation_specs order by job_id"
        ).fetchall()
        total = len(specs)
        jobs = [job for job, path, row, col in specs if not _in_annotation(path, row, col)]
        keep = set(random.Random(seed).sample(jobs, sample)) if 0 < sample < len(jobs) else set(jobs)
        if len(keep) < total:
            drop = [(job,) for job, *_ in specs if job not in keep]
            db.executemany("delete from mutation_specs where job_id = ?", drop)
            db.executemany("delete from work_items where job_id = ?", drop)
            db.commit()
        subprocess.run([*cosmic, "exec", str(config), str(session)], cwd=REPO, check=True)
        rows = _results(db)
    return _summary(module, tests, total, total - len(jobs), len(keep), seed, rows)


def _results(db: sqlite3.Connection) -> list[tuple]:
    return db.execute(
        "select s.module_path, s.start_pos_row, s.operator_name, r.test_outcome, r.diff "
        "from mutation_specs s join work_results r using (job_id) order by 1, 2, 3"
    ).fetchall()


def _summary(
    module: str,
    tests: str,
    total: int | None,
    in_annotations: int | None,
    sampled: int,
    seed: int,
    rows: list[tuple],
) -> dict:
    outcomes = [r[3].lower() for r in rows]  # cosmic-ray writes KILLED, SURVIVED, INCOMPETENT
    killed = sum(o == "killed" for o in outcomes)
    survivors, equivalent = _split_equivalent(
        [
            {
                "file": f,
                "line": line,
                "operator": op.split("/")[-1],
                "change": _change(diff),
            }
            for f, line, op, outcome, diff in rows
            if outcome.lower() == "survived"
        ]
    )
    competent = killed + len(survivors)  # neither a mutant that cannot be imported nor an equivalent one
    return {
        "module": module,
        "tests": tests,
        "mutants": total,
        "in_annotations": in_annotations,
        "sampled": sampled,
        "run": len(rows),
        "seed": seed,
        "killed": killed,
        "survived": len(survivors),
        "equivalent": equivalent,
        "incompetent": sum(o == "incompetent" for o in outcomes),
        "score": round(killed / competent, 3) if competent else None,
        "survivors": survivors,
    }


_ANNOTATIONS: dict[str, list[tuple[int, int, int, int]]] = {}


def _in_annotation(path: str, row: int, col: int) -> bool:
    """Whether a mutant sits in a type annotation: with ``from __future__ import annotations``
    those are strings at run time, so such a mutant cannot change behaviour (not counted)."""
    if path not in _ANNOTATIONS:
        tree = ast.parse((REPO / path).read_text())
        nodes = [
            n.annotation for n in ast.walk(tree) if isinstance(n, (ast.arg, ast.AnnAssign)) and n.annotation
        ]
        nodes += [
            n.returns
            for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns
        ]
        _ANNOTATIONS[path] = [(n.lineno, n.col_offset, n.end_lineno, n.end_col_offset) for n in nodes]
    return any((r0, c0) <= (row, col) < (r1, c1) for r0, c0, r1, c1 in _ANNOTATIONS[path])


def rerun(previous: dict) -> dict:
    """Run the survivors of an earlier report again (after new tests): each one's change is
    applied to its file, the target's tests run, and the file is restored."""
    targets = []
    for target in previous["targets"]:
        survivors, gone = [], []
        for mutant in target["survivors"]:
            outcome = _still_survives(mutant, target["tests"])
            (gone if outcome is None else survivors if outcome else []).append(mutant)
        newly_killed = target["survived"] - len(survivors) - len(gone)
        killed = target["killed"] + newly_killed
        survivors, equivalent = _split_equivalent(survivors)
        competent = killed + len(survivors)
        targets.append(
            {
                **target,
                "killed": killed,
                "survived": len(survivors),
                "equivalent": [*target.get("equivalent", []), *equivalent],
                "killed_on_rerun": target.get("killed_on_rerun", 0) + newly_killed,
                "gone_with_their_code": [
                    *target.get("gone_with_their_code", []),
                    *gone,
                ],
                "score": round(killed / competent, 3),
                "survivors": survivors,
            }
        )
    return targets


def _still_survives(mutant: dict, tests: str) -> bool | None:
    """Whether the mutant survives the tests now; None when the code it changed is gone."""
    path = REPO / mutant["file"]
    original = path.read_text()
    lines = original.splitlines()
    removed = [c[1:] for c in mutant["change"] if c.startswith("-")]
    added = [c[1:] for c in mutant["change"] if c.startswith("+")]
    while removed and added and not removed[-1].strip() and not added[-1].strip():
        removed, added = removed[:-1], added[:-1]  # a blank line the diff carried along
    starts = [i for i in range(len(lines)) if [x.rstrip() for x in lines[i : i + len(removed)]] == removed]
    if not starts:
        return None
    at = min(starts, key=lambda i: abs(i + 1 - mutant["line"]))
    try:
        path.write_text("\n".join(lines[:at] + added + lines[at + len(removed) :]) + "\n")
        return run_tests(tests) == 0
    finally:
        path.write_text(original)


def run_tests(tests: str) -> int:
    """The test command a mutant runs against: 0 when it survives."""
    quiet = {
        "cwd": REPO,
        "stdout": subprocess.DEVNULL,
        "stderr": subprocess.DEVNULL,
        "env": {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1"},
    }
    pytest = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        *tests.split(),
    ]
    try:
        if subprocess.run(pytest, check=False, timeout=120, **quiet).returncode:
            return 1
        check = [
            sys.executable,
            "-c",
            "import sys; from hfrewrite.cli import main; sys.exit(main())",
            "check",
            *(f"golden/{name}.py" for name in GOLDEN_SAMPLE),
        ]
        return subprocess.run(check, check=False, timeout=120, **quiet).returncode
    except subprocess.TimeoutExpired:
        return 1  # a mutant that hangs is caught too


def _change(diff: str) -> list[str]:
    """The removed and added lines of a mutant's diff."""
    return [
        line.rstrip()
        for line in diff.splitlines()
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--target",
        action="append",
        metavar="MODULE:TESTS",
        help="a module path and the tests run against its mutants "
        "(default: passes:tests/passes and hfrewrite/analyze:tests/analyze)",
    )
    parser.add_argument("--sample", type=int, default=0, help="mutants per target (0: all)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rerun", type=Path, help="run the survivors of this earlier report again")
    parser.add_argument(
        "--session",
        type=Path,
        help="summarize the session database of a run stopped early",
    )
    parser.add_argument(
        "--test",
        metavar="TESTS",
        help="run the tests a mutant is checked by (used by cosmic-ray)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.test:
        return run_tests(args.test)
    if args.out is None:
        parser.error("--out is required")
    targets = args.target or ["passes:tests/passes", "hfrewrite/analyze:tests/analyze"]
    if args.session:  # a run stopped early: what its session database holds
        module, tests = targets[0].split(":", 1)
        db = sqlite3.connect(args.session)
        sampled = db.execute("select count(*) from mutation_specs").fetchone()[0]
        results = [_summary(module, tests, None, None, sampled, args.seed, _results(db))]
    elif args.rerun:
        results = rerun(json.loads(args.rerun.read_text()))
    else:
        results = [mutate(*target.split(":", 1), args.sample, args.seed) for target in targets]
    killed = sum(r["killed"] for r in results)
    competent = killed + sum(r["survived"] for r in results)
    summary = {
        "score": round(killed / competent, 3) if competent else None,
        "killed": killed,
        "competent": competent,
        "targets": results,
    }
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    for r in results:
        print(
            f"{r['module']}: {r['killed']} of {r['killed'] + r['survived']} mutants killed ({r['score']}), "
            f"{len(r['equivalent'])} equivalent, {r['incompetent']} incompetent, of {r['mutants']}"
        )
    print(f"score {summary['score']}; {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
