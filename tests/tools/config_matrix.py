"""Validate each golden file on the released configs of its type (tests/data/hub_configs):
``python tests/tools/config_matrix.py [TYPE...] [--out FILE]``; one line per type.

The golden file itself runs (``hfrewrite check golden/`` proves it is what convert writes),
in real vLLM against Hugging Face, on a shrunk copy of each released config.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "data" / "hub_configs"


def validate_golden(model_type: str) -> dict:
    from hfrewrite.config_matrix import load_configs
    from hfrewrite.convert import Generated
    from hfrewrite.errors import HfrewriteError
    from hfrewrite.resolve import resolve
    from hfrewrite.verify.validate import validate

    resolved = resolve(model_type)
    golden = Generated(f"{model_type}.py", (ROOT / "golden" / f"{model_type}.py").read_text(), (), ())
    configs = load_configs(CONFIGS / model_type, model_type)
    start = time.perf_counter()
    outcome = {"type": model_type, "configs": [name for name, _ in configs]}
    failed = []
    for name, config in configs:  # one at a time: a refusal names its config
        try:
            validate(resolved, golden, ((name, config),))
        except HfrewriteError as exc:
            failed.append(f"{name}: {exc}")
    outcome.update(validated=len(configs) - len(failed), failed=failed, seconds=time.perf_counter() - start)
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("types", nargs="*")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    types = args.types or sorted(p.name for p in CONFIGS.iterdir() if p.is_dir())
    results = []
    for model_type in types:
        r = validate_golden(model_type)
        results.append(r)
        print(
            f"{model_type}: {r['validated']}/{len(r['configs'])} validate ({r['seconds']:.0f} s)", flush=True
        )
        for f in r["failed"]:
            print(f"  {f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all(not r["failed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
