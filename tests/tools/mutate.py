"""Mutation testing of the compiler (``make mutate``): cosmic-ray mutates one place of
``passes/`` at a time, on disk, and runs the fast pass tests against it; a mutant the tests
do not fail "survived". ``--sample N`` keeps a seeded random sample of the mutants (all of
them take hours on 2 cores). Writes the score and the survivors to ``--out`` (JSON).

    python tests/tools/mutate.py --sample 400 --seed 1 --out docs/mutation.json
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
CONFIG = """\
[cosmic-ray]
module-path = ["{module}"]
timeout = 60.0
excluded-modules = []
test-command = "{python} -m pytest -x -q -p no:cacheprovider {tests}"

[cosmic-ray.distributor]
name = "local"
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--module", default="passes")
    parser.add_argument("--tests", default="tests/passes")
    parser.add_argument("--sample", type=int, default=0, help="mutants to run (0: all)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cosmic = [str(Path(sys.executable).with_name("cosmic-ray"))]
    with tempfile.TemporaryDirectory(prefix="hfrewrite-mutate-") as tmp:
        config, session = Path(tmp) / "config.toml", Path(tmp) / "session.sqlite"
        config.write_text(CONFIG.format(module=args.module, python=sys.executable, tests=args.tests))
        subprocess.run([*cosmic, "init", str(config), str(session)], cwd=REPO, check=True)
        db = sqlite3.connect(session)
        jobs = [row[0] for row in db.execute("select job_id from mutation_specs order by job_id")]
        total = len(jobs)
        if args.sample and args.sample < total:
            keep = set(random.Random(args.seed).sample(jobs, args.sample))
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
    result = {
        "module": args.module, "tests": args.tests, "mutants": total, "run": len(rows),
        "seed": args.seed, "killed": killed, "survived": len(survivors),
        "incompetent": sum(o == "incompetent" for o in outcomes),
        "score": round(killed / len(rows), 3) if rows else None, "survivors": survivors,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{killed} of {len(rows)} mutants killed ({result['score']}), {len(survivors)} survived; {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
