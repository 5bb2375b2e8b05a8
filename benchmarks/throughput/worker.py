"""The worker process (``--worker IMPL``): one implementation (generated, native,
transformers or hf) answering the driver's JSON commands, one JSON line each."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.throughput.gemms import count_gemms

KV_CACHE_BYTES = 256 << 20


def vllm_env(cache_root: Path) -> dict[str, str]:
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine: fast LLM()
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(cache_root),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "TOKENIZERS_PARALLELISM": "false",
    }


class _LayerRanges:
    """Forward hooks that wrap every decoder layer in a profiler range."""

    MARKER = "hfrewrite_bench::decoder_layer"

    def __init__(self, model: Any, install: bool = True) -> None:
        import torch
        from torch import nn

        lists = [
            mod
            for name, mod in model.named_modules()
            if isinstance(mod, nn.ModuleList) and name.split(".")[-1].endswith("layers")
        ]
        self.layers = max(lists, key=len) if lists else []
        self.handles = []
        record = torch.profiler.record_function

        def pre(mod, args, kwargs=None):
            mod._hfrewrite_bench_range = record(self.MARKER)
            mod._hfrewrite_bench_range.__enter__()

        def post(mod, args, out):
            rng = getattr(mod, "_hfrewrite_bench_range", None)
            if rng is not None:
                rng.__exit__(None, None, None)
                mod._hfrewrite_bench_range = None

        for layer in self.layers if install else ():
            self.handles.append(layer.register_forward_pre_hook(pre))
            self.handles.append(layer.register_forward_hook(post))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _profile_events(prof: Any) -> list[tuple[str, tuple[str, ...]]]:
    out = []
    for ev in prof.events():
        chain = []
        parent = ev.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        out.append((ev.name, tuple(reversed(chain))))
    return out


class _VllmWorker:
    """One vLLM variant (generated / native / transformers) in this process; it loads
    one checkpoint after another (``load`` / ``unload``)."""

    def __init__(self, impl: str) -> None:
        self.impl = impl
        self.llm = None
        self._classes: dict[tuple[str, str], type] = {}

    def op_import(self) -> dict:
        t0 = time.perf_counter()
        import vllm  # noqa: F401
        from vllm import LLM, SamplingParams  # noqa: F401

        return {"import_s": time.perf_counter() - t0}

    def op_inspect_cold(self, architecture: str) -> dict:
        """Time vLLM's one-time model inspection of a lazily registered built-in class
        (a subprocess; cached on disk under VLLM_CACHE_ROOT, here a cold one)."""
        from vllm import ModelRegistry

        entry = ModelRegistry.models[architecture]
        t0 = time.perf_counter()
        entry.inspect_model_cls()
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        entry.inspect_model_cls()
        return {"cold_s": cold, "cached_s": time.perf_counter() - t0}

    def _register(self, architecture: str, generated_module: str | None) -> None:
        """Register the implementation as a class object: no inspection subprocess
        (vLLM's lazy registration would pay one per class, see ``op_inspect_cold``)."""
        from vllm import ModelRegistry
        from vllm.model_executor.model_loader import utils as loader_utils

        loader_utils._MODEL_ARCH_BY_HASH.clear()  # resolved-class cache per path
        if self.impl == "generated":
            key = (architecture, str(generated_module))
            if key not in self._classes:
                from hfrewrite.verify.engine import load_generated_class

                self._classes[key] = load_generated_class(Path(generated_module), architecture)
            ModelRegistry.register_model(architecture, self._classes[key])
        elif self.impl == "native":
            key = (architecture, "native")
            if key not in self._classes:
                entry = ModelRegistry.models[architecture]
                self._classes[key] = entry.load_model_cls()
            ModelRegistry.register_model(architecture, self._classes[key])
        else:
            for name in ("TransformersForCausalLM", "TransformersMoEForCausalLM"):
                key = (name, "transformers")
                if key not in self._classes:
                    self._classes[key] = ModelRegistry.models[name].load_model_cls()
                ModelRegistry.register_model(name, self._classes[key])

    def op_load(
        self,
        ckpt: str,
        architecture: str,
        max_model_len: int,
        generated_module: str | None = None,
        compile: bool = False,
        cache_root: str | None = None,
        dtype: str = "float32",
    ) -> dict:
        if cache_root:  # vLLM reads its environment lazily: a fresh compile cache
            os.environ["VLLM_CACHE_ROOT"] = cache_root
        self._register(architecture, generated_module)
        from vllm import LLM

        t0 = time.perf_counter()
        self.llm = LLM(
            model=ckpt,
            skip_tokenizer_init=True,
            dtype=dtype,
            max_model_len=max_model_len,
            enforce_eager=not compile,
            model_impl="transformers" if self.impl == "transformers" else "vllm",
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            enable_prefix_caching=False,
            seed=0,
        )
        startup = time.perf_counter() - t0
        model_class = self.llm.apply_model(lambda m: f"{type(m).__module__}.{type(m).__name__}")[0]
        return {"startup_s": startup, "model_class": model_class, **_threads()}

    def op_unload(self) -> dict:
        from vllm.distributed import parallel_state
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm = None
        gc.collect()
        if parallel_state._WORLD is not None:
            cleanup_dist_env_and_memory()
        return {}

    def _generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def op_generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        return _timed_generate(self._generate, prompts, max_tokens)

    def op_profile(self, prompts: list[list[int]], max_tokens: int, hooks: bool = True) -> dict:
        """GEMM calls per decoder layer over one prefill and ``max_tokens - 1`` decode
        steps (``max_tokens`` forwards). Without ``hooks`` (compiled models: a hook
        must not change what was compiled) only the whole-forward totals count."""
        ranges = self.llm.apply_model(lambda m: _LayerRanges(m, install=hooks))[0]
        return _profiled(self._generate, ranges, prompts, max_tokens)


def _threads() -> dict[str, Any]:
    """torch's intra-op thread count and the cores this process may run on."""
    import torch

    return {
        "torch_threads": torch.get_num_threads(),
        "affinity": sorted(os.sched_getaffinity(0)),
    }


def _timed_generate(generate: Any, prompts: list[list[int]], max_tokens: int) -> dict:
    """Wall time and this process's CPU time (all threads) of one generate call."""
    c0, t0 = time.process_time(), time.perf_counter()
    tokens = generate(prompts, max_tokens)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "seconds": seconds,
        "cpu_s": cpu,
        "n_out": sum(len(t) for t in tokens),
        "tokens": tokens,
    }


def _profiled(generate: Any, ranges: _LayerRanges, prompts: list[list[int]], max_tokens: int) -> dict:
    import torch

    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            generate(prompts, max_tokens)
    finally:
        ranges.remove()
    result = count_gemms(_profile_events(prof), _LayerRanges.MARKER)
    result["forwards"] = max_tokens
    result["layers"] = len(ranges.layers)
    return result


class _HfWorker:
    """Hugging Face ``generate`` (and the checkpoint builder) in this process."""

    def __init__(self, impl: str) -> None:
        self.model = None

    def op_import(self) -> dict:
        t0 = time.perf_counter()
        import torch  # noqa: F401
        import transformers  # noqa: F401

        return {"import_s": time.perf_counter() - t0}

    def op_make_checkpoint(self, model_type: str, out_dir: str, config: dict) -> dict:
        from hfrewrite.verify.fixtures import (
            checkpoint_architecture,
            make_tiny_checkpoint,
        )

        t0 = time.perf_counter()
        make_tiny_checkpoint(model_type, Path(out_dir), seed=0, **config)
        return {
            "seconds": time.perf_counter() - t0,
            "architecture": checkpoint_architecture(Path(out_dir)),
        }

    def op_load(self, ckpt: str, dtype: str = "float32", **_: Any) -> dict:
        import torch
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype)).eval()
        gen = self.model.generation_config
        gen.eos_token_id = None
        gen.pad_token_id = 0
        return {
            "startup_s": time.perf_counter() - t0,
            "model_class": type(self.model).__name__,
            **_threads(),
        }

    def op_unload(self) -> dict:
        self.model = None
        gc.collect()
        return {}

    def _generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        import torch

        ids = torch.tensor(prompts)  # equal lengths: one batch, no padding
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=self.model.generation_config,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
            )
        return out[:, ids.shape[1] :].tolist()

    def op_generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        return _timed_generate(self._generate, prompts, max_tokens)

    def op_profile(self, prompts: list[list[int]], max_tokens: int, hooks: bool = True) -> dict:
        return _profiled(self._generate, _LayerRanges(self.model, install=hooks), prompts, max_tokens)


def worker_main(impl: str) -> int:
    """``--worker IMPL``: answer JSON commands from stdin, one JSON line each."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the libraries print goes to the log, not the protocol
    worker = _HfWorker(impl) if impl == "hf" else _VllmWorker(impl)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            proto.write("{}\n")
            break
        t0 = time.perf_counter()
        try:
            result = getattr(worker, "op_" + cmd["op"])(**cmd.get("args", {}))
        except Exception:  # noqa: BLE001  (reported to the driver)
            result = {"error": traceback.format_exc(limit=-8)}
        result["wall_s"] = time.perf_counter() - t0
        proto.write(json.dumps(result) + "\n")
    return 0
