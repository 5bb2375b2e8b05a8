"""What every golden's proof in real vLLM asserts of one verify report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hfrewrite.verify import runner
from hfrewrite.verify.compare import LOGPROB_TOL, VerifyReport, _max_diff


def assert_equals_hf(report: VerifyReport) -> None:
    """The generated file ran in vLLM and decoded Hugging Face's greedy tokens (not repeats),
    chosen-token logprobs within the tolerance."""
    assert report.hf_tokens and len(set(report.hf_tokens[3])) > 4, "greedy decoding degenerated into repeats"
    assert report.generated_tokens == report.hf_tokens, report.summary()
    assert report.logprob_diff_hf is not None and report.logprob_diff_hf <= LOGPROB_TOL, report.summary()
    assert report.generated_class.startswith("hfrewrite_generated_"), report.summary()


def assert_native(report: VerifyReport, equal: bool, differs_because: str) -> None:
    """vLLM's own file decodes Hugging Face's tokens within the tolerance (``equal``), or
    decodes others, for the reason the caller knows (it fails when vLLM changes)."""
    assert report.native_tokens is not None, report.summary()
    if not equal:
        assert report.native_tokens != report.hf_tokens, f"no longer true: {differs_because}"
        return
    assert report.native_tokens == report.hf_tokens, report.summary()
    assert report.logprob_diff_native <= LOGPROB_TOL and report.problems == (), report.summary()


def assert_chunked_prefills_equal_hf(report: VerifyReport) -> None:
    """Prompts of 40 and 33 tokens with 16 tokens a step: each is prefilled in chunks, the
    later ones starting from the states the earlier ones cached, while the short prompt's
    decode steps run in the same batches; still Hugging Face's tokens and logprobs."""
    common = {
        "ckpt": report.ckpt,
        "prompts": [list(range(3, 43)), list(range(100, 133)), [5, 6, 7]],
        "max_tokens": 8,
        "architecture": report.architecture,
        "generated_module": report.generated_module,
    }
    budget = {"max_num_batched_tokens": 16, "enable_chunked_prefill": True, "max_num_seqs": 4}
    (hf, chunked), info = runner.run_worker(
        [{"kind": "hf", **common}, {"kind": "vllm", **common, "llm_kwargs": budget}]
    )
    assert "error" not in hf and "error" not in chunked, (
        hf.get("error"),
        chunked.get("error"),
        info["stderr_tail"],
    )
    assert chunked["tokens"] == hf["tokens"]
    diff = _max_diff(chunked["tokens"], chunked["logprobs"], hf["tokens"], hf["logprobs"])
    assert diff is not None and diff <= LOGPROB_TOL


# vLLM's own model file with its Mamba-1 mixer swapped for the golden's, run in a process of its
# own (vLLM's module is patched there): argv golden file, checkpoint, vLLM's model module
_SWAPPED = """
import importlib, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("golden_under_test", sys.argv[1])
golden = importlib.util.module_from_spec(spec)
spec.loader.exec_module(golden)
importlib.import_module(sys.argv[3]).MambaMixer = golden.TorchScanMambaMixer
from hfrewrite.verify.engine import hf_greedy, vllm_run
hf_tokens, hf_logprobs = hf_greedy(sys.argv[2])
run = vllm_run(sys.argv[2])
print(json.dumps({"tokens": run["tokens"], "logprobs": run["logprobs"], "class": run["model_class"],
                  "hf_tokens": hf_tokens, "hf_logprobs": hf_logprobs}))
"""


def assert_native_with_files_mixer(report: VerifyReport, native_module: str, native_class: str) -> None:
    """vLLM's own ``native_module`` (which vLLM's CPU build cannot run with its own Mamba-1
    mixer), its ``MambaMixer`` swapped for the golden's ``TorchScanMambaMixer``, runs as
    ``native_class`` on the report's checkpoint and decodes the golden's tokens, within the
    tolerance of Hugging Face's logprobs."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    done = subprocess.run(
        [sys.executable, "-c", _SWAPPED, report.generated_module, report.ckpt, native_module],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    native = json.loads(done.stdout.strip().splitlines()[-1])
    assert native["class"] == native_class
    assert native["hf_tokens"] == report.hf_tokens  # the same checkpoint and prompts
    assert native["tokens"] == report.generated_tokens
    diff = _max_diff(native["tokens"], native["logprobs"], native["hf_tokens"], native["hf_logprobs"])
    assert diff is not None and diff <= LOGPROB_TOL
