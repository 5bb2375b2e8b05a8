"""Subprocess worker for ``hfrewrite.verify.runner``: ``python -m hfrewrite.verify.worker JOB OUT``,
or ``--serve FD`` (``runner.VllmServer``): vLLM runs read one per line from stdin, each
result written as one JSON line to file descriptor FD, vLLM imported once.

JOB is JSON ``{"runs": [...]}`` (see ``runner.run_worker``). All Hugging Face runs go
first (vLLM's CPU worker later binds threads and memory), then the vLLM runs, each in
its own in-process ``LLM``. OUT is rewritten after every run, so a crash keeps the
results so far. Expects the environment of ``engine.vllm_env``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path


def main(job_path: str, out_path: str) -> int:
    from hfrewrite.verify import engine

    runs = json.loads(Path(job_path).read_text())["runs"]
    results: list[dict | None] = [None] * len(runs)
    state = {"import_s": None}

    def flush() -> None:  # null marks a run not done yet
        Path(out_path).write_text(json.dumps({"results": results, **state}))

    order = sorted(range(len(runs)), key=lambda i: runs[i]["kind"] != "hf")
    for i in order:
        run = runs[i]
        t0 = time.perf_counter()
        try:
            if run["kind"] == "hf":
                tokens, logprobs = engine.hf_greedy(
                    run["ckpt"],
                    run["prompts"],
                    run["max_tokens"],
                    run.get("dtype", "float32"),
                )
                result = {"tokens": tokens, "logprobs": logprobs}
            else:
                if state["import_s"] is None:
                    import vllm.entrypoints.llm  # noqa: F401  (timed once)

                    state["import_s"] = time.perf_counter() - t0
                    t0 = time.perf_counter()
                result = engine.vllm_run(
                    run["ckpt"],
                    run["prompts"],
                    run["max_tokens"],
                    run["generated_module"],
                    run["architecture"],
                    as_registered=run.get("as_registered", False),
                    llm_kwargs=run.get("llm_kwargs"),
                    record=run.get("record"),
                ) or {"unsupported": True}
        except Exception:  # noqa: BLE001  (reported in the result)
            result = {"error": traceback.format_exc(limit=-6)}
        result["seconds"] = time.perf_counter() - t0
        results[i] = result
        flush()
    return 0


def serve(out_fd: int) -> int:
    from hfrewrite.verify import engine

    with os.fdopen(out_fd, "w") as out:
        for line in sys.stdin:
            run = json.loads(line)
            t0 = time.perf_counter()
            try:
                result = engine.vllm_run(
                    run["ckpt"],
                    run["prompts"],
                    run["max_tokens"],
                    run["generated_module"],
                    run["architecture"],
                ) or {"unsupported": True}
            except Exception:  # noqa: BLE001  (reported in the result)
                result = {"error": traceback.format_exc(limit=-6)}
            result["seconds"] = time.perf_counter() - t0
            out.write(json.dumps(result) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        sys.exit(serve(int(sys.argv[2])))
    sys.exit(main(*sys.argv[1:3]))
