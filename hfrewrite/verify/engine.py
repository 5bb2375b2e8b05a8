"""In-process decoding runs: Hugging Face ``generate`` (the reference) and one vLLM ``LLM``
per run, with the generated class (or vLLM's native one) registered for its duration.

``vllm_*`` need the environment from ``vllm_env`` set before vLLM is imported; the
verification worker (``hfrewrite.verify.worker``) calls these, one process per batch.
``inspect_structure`` counts each decoder layer's linear-layer kinds.

vLLM facts this relies on (0.32, CPU): several ``LLM`` instances in one process work
when each is dropped before the next (its shutdown tears the distributed env down);
vLLM caches the resolved model class per checkpoint path (cleared around each run);
a lazily registered class costs a ~12 s inspection subprocess (classes are registered
as objects); a torch.compile'd logprob helper costs ~15 s (``TORCHDYNAMO_DISABLE``).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import itertools
import json
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hfrewrite.verify.fixtures import (
    DEFAULT_PROMPTS,
    checkpoint_architecture,
    runs_custom_code,
    uses_latent_attention,
)
from hfrewrite.verify.vllm_tables import attention_free_hook, config_hooks, config_registry, config_shims

MAX_MODEL_LEN = 128
KV_CACHE_BYTES = 64 << 20  # plenty for tiny models; a freed LLM returns it

# Linear-layer kinds counted per decoder layer, most specific first.
LINEAR_KINDS = (
    "MoERunner",  # vLLM's fused MoE (FusedMoEFactory), one per MoE layer
    "GateLinear",  # vLLM's MoE router
    "QKVParallelLinear",
    "MergedColumnParallelLinear",
    "RowParallelLinear",
    "ColumnParallelLinear",
    "ReplicatedLinear",
    "Linear",  # torch.nn.Linear: not a vLLM parallel layer
)

Tokens = list[list[int]]
Logprobs = list[list[float]]


def hf_model(ckpt: Path, dtype: str = "float32", **options: Any) -> Any:
    """The checkpoint's Hugging Face causal LM in ``dtype`` (float32 unless asked), in eval
    mode, with transformers' reference (eager) attention: soft caps and sliding windows exactly.
    ``options`` go to ``from_pretrained``."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        ckpt,
        dtype=getattr(torch, dtype),
        attn_implementation="eager",
        trust_remote_code=runs_custom_code(ckpt),
        **options,
    ).eval()


def hf_greedy(
    ckpt: Path,
    prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS,
    max_tokens: int = 16,
    dtype: str = "float32",
) -> tuple[Tokens, Logprobs]:
    """Greedy tokens and their logprobs from Hugging Face ``generate`` (float32).

    Each prompt runs alone (no padding). EOS does not stop generation, as with
    vLLM's ``ignore_eos=True``; logprobs come from the raw logits.
    """
    model = hf_model(ckpt, dtype)
    if runs_custom_code(ckpt):  # the repository's own cache code may predate transformers' Cache
        return greedy_without_cache(model, prompts, max_tokens)
    try:
        return _generated(model, prompts, max_tokens)
    except ValueError as exc:
        # transformers' cache of a model with no attention layer (Bamba's Mamba-2 layers alone)
        # tracks no length, so generate cannot decode it; the full recompute can
        if "only contain LinearAttention layers" not in str(exc):
            raise
        return greedy_without_cache(model, prompts, max_tokens)


def _generated(model, prompts: Sequence[Sequence[int]], max_tokens: int) -> tuple[Tokens, Logprobs]:
    """Greedy tokens and their logprobs from ``model.generate``, each prompt alone."""
    import torch

    gen_config = model.generation_config
    gen_config.eos_token_id = None
    gen_config.pad_token_id = 0
    # a released config's `use_mtp` (MiniMax-M2.7) asks generate for multi-token-prediction
    # drafts, from MTP layers the main model's greedy decode does not need
    gen_config.use_mtp = False
    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=gen_config,
                max_new_tokens=max_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            new = out.sequences[0, ids.shape[1] :].tolist()
            lps = [torch.log_softmax(step[0].float(), -1)[tok].item() for step, tok in zip(out.logits, new)]
            tokens.append(new)
            logprobs.append(lps)
    return tokens, logprobs


def hf_float32_error(
    ckpt: Path, prompts: Sequence[Sequence[int]], tokens: Tokens, logprobs: Logprobs
) -> float:
    """How far transformers' float32 chosen-token ``logprobs`` of the greedy ``tokens`` are
    from its float64 ones on the same sequences (0.0 where the model does not run in float64)."""
    import torch

    try:
        # experts one by one: the grouped kernel has no float64
        model = hf_model(ckpt, "float64", experts_implementation="eager")
        errors = [0.0]
        with torch.no_grad():
            for prompt, new, lps in zip(prompts, tokens, logprobs):
                ids = torch.tensor([[*prompt, *new]])
                logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1]
                exact = torch.log_softmax(logits, -1).gather(-1, torch.tensor(new)[:, None])[:, 0]
                errors.append(float((exact - torch.tensor(lps, dtype=torch.float64)).abs().max()))
    except Exception:  # noqa: BLE001 - a model that cannot run in float64 keeps the fixed tolerance
        return 0.0
    return max(errors)


def greedy_without_cache(model, prompts: Sequence[Sequence[int]], max_tokens: int) -> tuple[Tokens, Logprobs]:
    """Greedy tokens and their logprobs by full recompute at each step (``use_cache=False``):
    neither the model's cache code nor ``generate`` plays a part (Hub custom code written
    for another transformers keeps its own tuple caches)."""
    import torch

    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            new, lps = [], []
            for _ in range(max_tokens):
                logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()
                token = int(logits.argmax())
                lps.append(torch.log_softmax(logits, -1)[token].item())
                new.append(token)
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            tokens.append(new)
            logprobs.append(lps)
    return tokens, logprobs


def vllm_env(cache_root: Path | str) -> dict[str, str]:
    """Environment for running vLLM on CPU in-process (set before importing vLLM)."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine: ~3 s per LLM()
        "VLLM_CACHE_ROOT": str(cache_root),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # vLLM torch.compile's a logprob helper even with enforce_eager: ~15 s of
        # inductor C++ compile on first use. Eager is numerically identical.
        "TORCHDYNAMO_DISABLE": "1",
        # multi-process runs (tensor parallel) talk over loopback only
        "VLLM_HOST_IP": "127.0.0.1",
    }


_module_counter = itertools.count()


def load_generated_class(path: Path, architecture: str) -> type:
    """Import the file at ``path`` under a unique module name; return its class."""
    name = f"hfrewrite_generated_{next(_module_counter)}_{Path(path).stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return getattr(module, architecture)


@contextmanager
def _registered(architecture: str, model_cls: type | None) -> Iterator[bool]:
    """Register ``model_cls`` (or vLLM's native class when None) under ``architecture``
    for the duration; restore the previous registry entry after. Yields whether an
    implementation is registered (False: vLLM has no native one).

    Native classes are registered as class objects: a lazy entry would cost a ~12 s
    inspection subprocess on each first use.
    """
    from vllm import ModelRegistry
    from vllm.model_executor.model_loader import utils as loader_utils
    from vllm.plugins import load_general_plugins

    # Installed plugins register their classes when the engine starts, over whatever is
    # registered then: load them now (once per process), so the class registered below is
    # the one that runs, whatever plugin for the same architecture is installed.
    load_general_plugins()
    # vLLM caches the resolved class per (model path, architectures, ...): without
    # clearing it, a native run after a generated run of the same checkpoint in one
    # process silently reuses the generated class (and vice versa).
    loader_utils._MODEL_ARCH_BY_HASH.clear()
    models = ModelRegistry.models
    previous = models.get(architecture)
    if model_cls is None:
        entry = _native_entry(architecture)
        if entry is None:
            yield False
            return
        model_cls = entry.load_model_cls()
    ModelRegistry.register_model(architecture, model_cls)
    hooked = attention_free_hook(architecture, model_cls)
    shims = config_shims(sys.modules.get(model_cls.__module__))
    registry = config_registry()
    before = {model_type: dict.get(registry, model_type) for model_type in shims}
    registry.update(shims)
    try:
        yield True
    finally:
        for model_type, entry in before.items():
            if entry is None:
                registry.pop(model_type, None)
            else:
                registry[model_type] = entry
        loader_utils._MODEL_ARCH_BY_HASH.clear()
        if hooked:
            config_hooks().pop(architecture, None)
        if previous is None:
            models.pop(architecture, None)
        else:
            models[architecture] = previous


def _native_snapshot() -> dict:
    """vLLM's built-in registry entries, taken before anything is registered."""
    from vllm import ModelRegistry

    return {
        arch: entry
        for arch, entry in ModelRegistry.models.items()
        if getattr(entry, "module_name", "").startswith("vllm.model_executor.models.")
    }


_NATIVE: dict = {}


def _native_entry(architecture: str):
    """vLLM's built-in entry for ``architecture``; else the one entry spelled the same but
    for capitals (transformers renamed some classes; vLLM registers the Hub configs'
    spelling: ``PhimoeForCausalLM`` is its ``PhiMoEForCausalLM``); else None."""
    if architecture in _NATIVE:
        return _NATIVE[architecture]
    same = [a for a in _NATIVE if a.casefold() == architecture.casefold()]
    return _NATIVE[same[0]] if len(same) == 1 else None


class VllmRunError(RuntimeError):
    """A vLLM run failed; the message holds the original traceback as text."""


def vllm_run(
    ckpt: Path,
    prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS,
    max_tokens: int = 16,
    generated_module: Path | None = None,
    architecture: str | None = None,
    *,
    as_registered: bool = False,
    llm_kwargs: dict[str, Any] | None = None,
    record: str | None = None,
) -> dict[str, Any] | None:
    """Greedy-decode ``ckpt`` in one in-process vLLM ``LLM`` and inspect its module.

    With ``generated_module``, its ``architecture`` class replaces vLLM's for this run;
    without, vLLM's native class runs (None is returned when vLLM has none). With
    ``as_registered``, the registry is left as vLLM found it (a plugin or an edited vLLM
    tree decides the class). ``llm_kwargs`` go to ``LLM`` (``tensor_parallel_size``: the
    class must then be registered in the workers too, i.e. by a plugin). Returns
    ``{"tokens", "logprobs", "structure", "model_class", "model_file", "supports_pp",
    "init_s", "gen_s"}``; raises ``VllmRunError`` after tearing the failed engine down,
    so the next run can start. ``record``: a file to save every module's output of one more
    forward pass to (``divergence.record_vllm``; a failure there is only reported).
    """
    global _NATIVE
    from vllm.distributed import parallel_state
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    if not _NATIVE:
        _NATIVE = _native_snapshot()
    architecture = architecture or checkpoint_architecture(ckpt)
    cls = load_generated_class(generated_module, architecture) if generated_module else None
    with contextlib.nullcontext(True) if as_registered else _registered(architecture, cls) as available:
        if not available:
            return None
        error = None
        try:
            result = _run_engine(ckpt, prompts, max_tokens, llm_kwargs, record)
        except Exception:  # noqa: BLE001  (reported, not swallowed)
            # Keep only text: the traceback's frames would keep the engine alive, and
            # its deferred shutdown would later tear down the *next* engine's state.
            error = traceback.format_exc()
    # The engine shuts down (distributed env included) once unreferenced; collect
    # only when a reference cycle kept it alive (each collect costs ~1 s).
    if parallel_state._WORLD is not None or error is not None:
        gc.collect()
        cleanup_dist_env_and_memory()
    if error is not None:
        raise VllmRunError(error)
    return result


def _mla_backend(ckpt: Path, options: dict) -> dict:
    """On a CPU with AMX tiles vLLM runs latent attention (MLA) with its AMX backend, which
    packs bfloat16/float16/int8 weights only: a float32 run of an MLA checkpoint asks for
    vLLM's reference CPU_MLA backend instead (a bfloat16 one keeps AMX)."""
    float32 = options.get("dtype") == "float32"
    if float32 and uses_latent_attention(ckpt) and "attention_backend" not in options:
        return {"attention_backend": "CPU_MLA"}
    return {}


def _chunk_blocks(config: dict, options: dict) -> dict:
    """vLLM's chunked attention needs chunks of whole cache blocks, 128 tokens on CPU by
    default: a checkpoint chunking by fewer (32, the validation's) runs with blocks of 32
    (a multimodal checkpoint's chunk is its text config's)."""
    chunk = config.get("attention_chunk_size") or config.get("text_config", {}).get("attention_chunk_size")
    if isinstance(chunk, int) and chunk % 128 and not chunk % 32 and "block_size" not in options:
        return {"block_size": 32}
    return {}


def _run_engine(
    ckpt: Path,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    llm_kwargs: dict[str, Any] | None = None,
    record: str | None = None,
) -> dict:
    """Build an ``LLM`` for whatever class is registered, decode, inspect, drop it."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    # a config shim registered for the checkpoint's model type loads its config.json without
    # the repository's code (as vLLM's own shims do)
    config = json.loads((Path(ckpt) / "config.json").read_text())
    model_type = config.get("model_type")
    remote = runs_custom_code(ckpt) and model_type not in config_registry()
    options = {"dtype": "float32", "trust_remote_code": remote, **(llm_kwargs or {})}
    options.update(_mla_backend(ckpt, options))
    options.update(_chunk_blocks(config, options))
    llm = LLM(
        model=str(ckpt),
        skip_tokenizer_init=True,
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        model_impl="vllm",  # never fall back to the Transformers backend
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        seed=0,
        **options,
    )
    t1 = time.perf_counter()
    params = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        ignore_eos=True,
        detokenize=False,
        logprobs=1,
    )
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    t2 = time.perf_counter()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [
        [pos[tok].logprob for pos, tok in zip(o.outputs[0].logprobs, toks)] for o, toks in zip(outs, tokens)
    ]
    # A module-level function: with tensor parallelism it is pickled to the workers.
    facts = llm.apply_model(_model_facts)[0]
    if "speculative_config" in options:  # what the draft proposed and the model accepted
        facts["spec_decode"] = {
            m.name.removeprefix("vllm:spec_decode_"): getattr(m, "value", getattr(m, "values", None))
            for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_")
        }
    if record:
        from hfrewrite.verify import divergence

        try:
            divergence.record_vllm(llm, record_prompt(prompts), Path(record))
        except Exception as exc:  # noqa: BLE001  (a diagnosis only)
            facts["record_error"] = f"{type(exc).__name__}: {exc}"
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        **facts,
        "init_s": t1 - t0,
        "gen_s": t2 - t1,
    }


def record_prompt(prompts: Sequence[Sequence[int]]) -> list[int]:
    """The prompt the divergence recording runs: the longest (a position-dependent bug shows
    after the first token), reversed, so that no cached prefix of the decoding before it
    shortens the pass."""
    return list(reversed(max(prompts, key=len)))


def _model_facts(model: Any) -> dict[str, Any]:
    """What ran: linear-layer structure, class, its file, vLLM's ``supports_pp`` and, for
    a ``MixtureOfExperts`` model, how many MoE layers it declares."""
    from vllm.model_executor.models.interfaces import is_mixture_of_experts, supports_pp

    cls = type(model)
    return {
        "structure": inspect_structure(model),
        "model_class": f"{cls.__module__}.{cls.__name__}",
        "model_file": getattr(sys.modules.get(cls.__module__), "__file__", None),
        "supports_pp": bool(supports_pp(model)),
        "num_moe_layers": model.num_moe_layers if is_mixture_of_experts(model) else None,
    }


def vllm_greedy(
    ckpt: Path,
    prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS,
    max_tokens: int = 16,
    generated_module: Path | None = None,
    architecture: str | None = None,
) -> tuple[Tokens, Logprobs] | None:
    """Greedy tokens and chosen-token logprobs from vLLM, in this process (see
    ``vllm_run``). None when native is asked for and vLLM has no implementation."""
    run = vllm_run(ckpt, prompts, max_tokens, generated_module, architecture)
    return None if run is None else (run["tokens"], run["logprobs"])


def inspect_structure(model: Any) -> list[dict[str, int]]:
    """Per decoder layer, how many modules of each ``LINEAR_KINDS`` kind it holds.

    Decoder layers are the longest ``nn.ModuleList`` whose name ends in ``layers``, else
    (dbrx's ``blocks``) the longest one not inside another list's element.
    A module counts under the first kind found in its class's MRO, so a subclass of
    ``QKVParallelLinear`` counts as QKV, not as ``ColumnParallelLinear``.
    """
    from torch import nn

    named = {name: mod for name, mod in model.named_modules() if isinstance(mod, nn.ModuleList)}
    lists = [mod for name, mod in named.items() if name.split(".")[-1].endswith("layers")]
    lists = lists or [
        mod for name, mod in named.items() if not any(name.startswith(f"{other}.") for other in named)
    ]
    if not lists:
        return []
    layers = max(lists, key=len)
    result = []
    for layer in layers:
        counts = dict.fromkeys(LINEAR_KINDS, 0)
        for mod in layer.modules():
            for klass in type(mod).__mro__:
                name = klass.__name__
                if klass is nn.Linear or (name in counts and name != "Linear"):
                    counts[name] += 1
                    break
        result.append(counts)
    return result
