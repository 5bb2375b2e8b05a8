"""The child process of an isolated analysis: ``python -m hfrewrite.isolate.front JOB OUT``.

Runs under a transformers overlay (``environment.py``). JOB (json) names the repository and
what to do; OUT receives a pickle of plain data and hfrewrite's own plan dataclasses, never
objects of the repository's classes (they do not exist on the other side):

* ``analyze``: resolve the repository with its own code, analyse it (``analyze.model``), and
  describe its configuration class for the emitted config shim;
* ``references``: build the tiny validation checkpoint of each config (the repository's own
  class saves it) and decode it greedily by full recompute, as the reference vLLM must meet;
* ``decode``: that greedy decoding of a given checkpoint (``verify CHECKPOINT_DIR``).
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import sys
import traceback
from pathlib import Path


def _load(job: dict):
    """(config, model class) of the repository, built by its own code."""
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    where, revision = job["model_id"], job.get("revision")
    config = AutoConfig.from_pretrained(where, trust_remote_code=True, revision=revision)
    reference = config.auto_map["AutoModelForCausalLM"]
    return config, get_class_from_dynamic_module(reference, where, revision=revision)


def analyze(job: dict) -> dict:
    import inspect

    import transformers

    from hfrewrite.analyze.model import analyze as analyze_config

    config, model_class = _load(job)
    plan = analyze_config(config)
    siblings = tuple((what, c.to_dict()) for what, c in plan.sibling_configs)
    return {
        "plan": dataclasses.replace(plan, sibling_configs=siblings),
        "config": config.to_dict(),
        "modeling_path": inspect.getsourcefile(model_class),
        "modeling_module": model_class.__module__,
        "config_class": type(config).__name__,
        "config_path": inspect.getsourcefile(type(config)),
        "transformers_version": transformers.__version__,
    }


def references(job: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from hfrewrite.verify import fixtures
    from hfrewrite.verify.engine import greedy_without_cache
    from hfrewrite.verify.validate import validation_config

    config, _ = _load(job)
    out = []
    for i, (what, data) in enumerate(job["configs"]):
        small = validation_config(config if data is None else type(config).from_dict(data))
        prompts = [[t % small.vocab_size for t in p] for p in job["prompts"]]
        ckpt = fixtures.save_random_checkpoint(small, Path(job["out_dir"]) / f"ckpt{i}", job.get("seed", 0))
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, trust_remote_code=True).eval()
        tokens, logprobs = greedy_without_cache(model, prompts, job["max_tokens"])
        saved = type(config).from_pretrained(ckpt)
        out.append(
            {
                "what": what,
                "ckpt": str(ckpt),
                "prompts": prompts,
                "tokens": tokens,
                "logprobs": logprobs,
                "config_values": _values(saved),
            }
        )
    return {"references": out}


def decode(job: dict) -> dict:
    """Greedy tokens and logprobs of a checkpoint the repository's code saved."""
    import torch
    from transformers import AutoModelForCausalLM

    from hfrewrite.verify.engine import greedy_without_cache

    model = AutoModelForCausalLM.from_pretrained(
        job["ckpt"], dtype=torch.float32, trust_remote_code=True
    ).eval()
    tokens, logprobs = greedy_without_cache(model, job["prompts"], job["max_tokens"])
    return {"tokens": tokens, "logprobs": logprobs}


def _values(config) -> dict:
    """The attributes the repository's class sets beyond transformers' base defaults (json
    values): what a config shim must load the same."""
    from transformers import PretrainedConfig

    base = vars(PretrainedConfig())
    skip = {"transformers_version", "torch_dtype", "dtype"}
    own = {
        key: value
        for key, value in vars(config).items()
        if not key.startswith("_") and key not in skip and (key not in base or base[key] != value)
    }
    return json.loads(json.dumps(own, default=repr, sort_keys=True))


def main(job_path: str, out_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    try:
        result = {"analyze": analyze, "references": references, "decode": decode}[job["kind"]](job)
    except Exception as exc:  # noqa: BLE001 - reported to the parent as one line
        from hfrewrite.errors import HfrewriteError

        line = (str(exc).strip().splitlines() or [""])[0]
        message = line if isinstance(exc, HfrewriteError) else f"{type(exc).__name__}: {line}"
        result = {"error": message, "traceback": traceback.format_exc()}
    Path(out_path).write_bytes(pickle.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
