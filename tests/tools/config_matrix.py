"""Validate each golden file on the released configs of its type (tests/data/hub_configs):
``python tests/tools/config_matrix.py [TYPE...] [--out FILE]``; one line per type.

The golden file itself runs (``hfrewrite check golden/`` proves it is what convert writes),
in real vLLM against Hugging Face, on a shrunk copy of each released config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "data" / "hub_configs"


def validate_golden(model_type: str) -> dict:
    """The golden file of ``model_type`` validated on each released config of its type, all in
    one vLLM worker: {"type", "configs", "validated", "failed": ["config: problem"], "seconds"}."""
    from hfrewrite.config_matrix import load_configs
    from hfrewrite.convert import Generated, generate, with_layer_types
    from hfrewrite.resolve import resolve
    from hfrewrite.verify.validate import validate_each

    source = ROOT / "golden" / "configs" / model_type  # the config the golden was converted from
    resolved = resolve(str(source) if source.is_dir() else model_type)
    golden = Generated(f"{model_type}.py", (ROOT / "golden" / f"{model_type}.py").read_text(), (), ())
    configs = list(load_configs(CONFIGS / model_type, model_type))
    made = generate(resolved)  # what convert knows of the file beyond its text: its vLLM dtype
    if made.vllm_dtype != "float32":  # state layers in bfloat16 (verify/state_layers.py)
        golden = dataclasses.replace(golden, vllm_dtype=made.vllm_dtype, state_layer=made.state_layer)
        if made.attention_layer_type:  # and each config with attention in every layer, in float32
            every = [
                (f"{name} with attention in every layer", with_layer_types(config, made.attention_layer_type))
                for name, config in configs
            ]
            golden = dataclasses.replace(golden, float32_siblings=tuple(name for name, _ in every))
            configs += every
    start = time.perf_counter()
    outcomes = validate_each(resolved, golden, configs)
    failed = [f"{what}: {report.problems[0]}{where}" for what, report, where in outcomes if not report.ok]
    return {
        "type": model_type,
        "configs": [name for name, _ in configs],
        "validated": len(configs) - len(failed),
        "failed": failed,
        "seconds": time.perf_counter() - start,
    }


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
