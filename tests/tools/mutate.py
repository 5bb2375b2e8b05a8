"""Mutation testing of the compiler (``make mutate``): cosmic-ray mutates one place of
``passes/`` (or ``hfrewrite/analyze/``) at a time, on disk, and runs that part's fast tests
against it; a mutant the tests do not fail "survived". ``--sample N`` keeps a seeded random
sample of each target's mutants (all of them take hours on 2 cores). Writes the score and
the survivors to ``--out`` (JSON).

    python tests/tools/mutate.py --sample 200 --seed 1 --out docs/mutation.json
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# No .pyc is written while a mutant is in place: one written in the same second as the
# restore, for a mutant of the same size, would be taken for the restored file.
CONFIG = """\
[cosmic-ray]
module-path = ["{module}"]
timeout = 60.0
excluded-modules = []
test-command = "env PYTHONDONTWRITEBYTECODE=1 {python} -m pytest -x -q -p no:cacheprovider {tests}"

[cosmic-ray.distributor]
name = "local"
"""


def mutate(module: str, tests: str, sample: int, seed: int) -> dict:
    """Run a seeded sample of the mutants of ``module`` against ``tests``; the outcome counts."""
    cosmic = [str(Path(sys.executable).with_name("cosmic-ray"))]
    with tempfile.TemporaryDirectory(prefix="hfrewrite-mutate-") as tmp:
        config, session = Path(tmp) / "config.toml", Path(tmp) / "session.sqlite"
        config.write_text(CONFIG.format(module=module, python=sys.executable, tests=tests))
        subprocess.run([*cosmic, "init", str(config), str(session)], cwd=REPO, check=True)
        db = sqlite3.connect(session)
        jobs = [row[0] for row in db.execute("select job_id from mutation_specs order by job_id")]
        total = len(jobs)
        if sample and sample < total:
            keep = set(random.Random(seed).sample(jobs, sample))
            drop = [(j,) for j in jobs if j not in keep]
            db.executemany("delete from mutation_specs where job_id = ?", drop)
            db.executemany("delete from work_items where job_id = ?", drop)
            db.commit()
        subprocess.run([*cosmic, "exec", str(config), str(session)], cwd=REPO, check=True)
        rows = db.execute(
            "select s.module_path, s.start_pos_row, s.operator_name, r.test_outcome, r.diff "
            "from mutation_specs s join work_results r using (job_id) order by 1, 2, 3").fetchall()
    outcomes = [r[3] for r in rows]
    killed = sum(o == "killed" for o in outcomes)
    survivors = [{"file": f, "line": line, "operator": op, "diff": diff}
                 for f, line, op, outcome, diff in rows if outcome == "survived"]
    competent = killed + len(survivors)  # a mutant that cannot even be imported is not counted
    return {
        "module": module, "tests": tests, "mutants": total, "run": len(rows), "seed": seed,
        "killed": killed, "survived": len(survivors),
        "incompetent": sum(o == "incompetent" for o in outcomes),
        "score": round(killed / competent, 3) if competent else None, "survivors": survivors,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", action="append", metavar="MODULE:TESTS",
                        help="a module path and the tests run against its mutants "
                             "(default: passes:tests/passes and hfrewrite/analyze:tests/analyze)")
    parser.add_argument("--sample", type=int, default=0, help="mutants per target (0: all)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    targets = args.target or ["passes:tests/passes", "hfrewrite/analyze:tests/analyze"]
    results = [mutate(*target.split(":", 1), args.sample, args.seed) for target in targets]
    killed = sum(r["killed"] for r in results)
    competent = killed + sum(r["survived"] for r in results)
    summary = {"score": round(killed / competent, 3) if competent else None, "killed": killed,
               "competent": competent, "targets": results}
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    for r in results:
        print(f"{r['module']}: {r['killed']} of {r['killed'] + r['survived']} mutants killed ({r['score']}), "
              f"{r['incompetent']} incompetent, of {r['mutants']}")
    print(f"score {summary['score']}; {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
