"""What convert-time validation costs (``make validation-cost``): ``hfrewrite convert TYPE``
with and without ``--no-verify``, side by side per type in one run (the machine's noise hits
both), wall-clock seconds of the whole process. Writes JSON to ``--out`` and prints the
markdown table docs/reliability.md shows.

    python tests/tools/validation_cost.py --out docs/validation-cost.json llama qwen3_moe
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HFREWRITE = str(Path(sys.executable).with_name("hfrewrite"))


def timed_convert(model: str, out: Path, verify: bool) -> tuple[float, int]:
    cmd = [HFREWRITE, "convert", model, "-o", str(out), "--force"] + ([] if verify else ["--no-verify"])
    start = time.perf_counter()
    rc = subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    return time.perf_counter() - start, rc


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("types", nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hfrewrite-valcost-") as tmp:
        for model in args.types:
            plain, plain_rc = timed_convert(model, Path(tmp), verify=False)
            checked, checked_rc = timed_convert(model, Path(tmp), verify=True)
            rows.append(
                {
                    "type": model,
                    "no_verify_s": round(plain, 1),
                    "validated_s": round(checked, 1),
                    "added_s": round(checked - plain, 1),
                    "ok": plain_rc == 0 and checked_rc == 0,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    added = [r["added_s"] for r in rows]
    summary = {
        "rows": rows,
        "median_added_s": round(statistics.median(added), 1),
        "max_added_s": max(added),
        "max_validated_s": max(r["validated_s"] for r in rows),
        "max_no_verify_s": max(r["no_verify_s"] for r in rows),
    }
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print("| type | `--no-verify` (s) | validated (s) | added (s) |\n|---|---|---|---|")
    for r in rows:
        flag = "" if r["ok"] else " (failed)"
        print(f"| {r['type']}{flag} | {r['no_verify_s']} | {r['validated_s']} | {r['added_s']} |")
    print(f"\nmedian added {summary['median_added_s']} s, at most {summary['max_added_s']} s")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
