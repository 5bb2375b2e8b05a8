"""Prove a generated vLLM model file in real vLLM.

A tiny random-weight Hugging Face checkpoint is decoded greedily three ways: by
Hugging Face ``generate`` (the reference), by vLLM running the generated model file,
and by vLLM's own implementation of the architecture (when it has one). The generated
file passes when its tokens equal both and its chosen-token logprobs agree within
``LOGPROB_TOL``. The structure of the loaded vLLM module (which fused parallel linear
layers each decoder layer uses) is reported next to vLLM's native structure.

Process model: ``verify``/``verify_many`` run everything in one subprocess
(``python -m hfrewrite.verify.worker``), so this module never imports vLLM in the
caller. Inside that worker all Hugging Face runs happen first, then every vLLM run
builds one in-process ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), drops it and
builds the next: vLLM is imported once per batch, however many checkpoints it holds.

The in-process primitives (``hf_greedy``, ``vllm_greedy``, ``vllm_run``,
``inspect_structure``) are public too; ``vllm_*`` need the environment from
``vllm_env`` to be set before vLLM is imported. ``make_tiny_checkpoint`` builds test
checkpoints, ``write_vllm_standin`` copies vLLM's own model file as a known-good (or
deliberately broken) stand-in, ``main`` backs ``hfrewrite verify``.

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
import os
import re
import select
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Token ids < 500 of varied lengths (1 to 40); fits the default vocab (512) and
# max_model_len (128) with 16 new tokens.
DEFAULT_PROMPTS: tuple[tuple[int, ...], ...] = (
    (7,),
    (5, 6, 7, 8, 9),
    (100, 200, 300, 400, 17, 42, 250, 3, 99, 480, 11, 12, 13),
    tuple((i * 37 + 11) % 497 + 3 for i in range(40)),
)
LOGPROB_TOL = 1e-4
MAX_MODEL_LEN = 128
KV_CACHE_BYTES = 64 << 20  # plenty for tiny models; a freed LLM returns it

TINY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # the CPU attention backend needs head_dim >= 32
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}

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


# --------------------------------------------------------------------------- checkpoint


def make_tiny_checkpoint(
    model_type: str, out_dir: Path, seed: int = 0, **config_overrides: Any
) -> Path:
    """Write a tiny random-weight float32 HF checkpoint (safetensors, no tokenizer).

    ``config_overrides`` go to ``AutoConfig.for_model`` on top of ``TINY_DEFAULTS``,
    e.g. ``tie_word_embeddings=True``, ``attention_bias=True``, ``head_dim=64``,
    ``rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}``.
    Init is widened so greedy decoding does not collapse into repeats: matrices and
    biases ~ N(0, 0.2), 1-D weights (norms) ~ N(1, 0.2).
    """
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **{**TINY_DEFAULTS, **config_overrides})
    pad = getattr(config, "pad_token_id", None)
    if isinstance(pad, int) and pad >= config.vocab_size:  # a real model's pad id, past the tiny vocab
        config.pad_token_id = None
    return save_random_checkpoint(config, out_dir, seed)


def save_random_checkpoint(config: Any, out_dir: Path, seed: int = 0) -> Path:
    """Build ``config``'s causal LM with ``make_tiny_checkpoint``'s widened random init
    (float32) and save it to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights appear once
            if param.ndim >= 2 or name.endswith("bias"):
                param.normal_(0.0, 0.2)
            else:
                param.normal_(1.0, 0.2)
        for name, buffer in model.named_buffers():  # a router's score-correction bias
            if name.endswith("bias") and buffer.is_floating_point() and name in model.state_dict():
                buffer.normal_(0.0, 0.2)
    model.config.architectures = [type(model).__name__]
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


def checkpoint_architecture(ckpt: Path) -> str:
    """The first entry of ``architectures`` in the checkpoint's config.json."""
    return json.loads((Path(ckpt) / "config.json").read_text())["architectures"][0]


def write_vllm_standin(
    dst: Path, name: str = "llama", replace: dict[str, str] | None = None
) -> Path:
    """Write vLLM's own ``vllm/model_executor/models/<name>.py`` to ``dst``, relative
    imports made absolute, as a stand-in for a generated file (a known-good reference).

    ``replace`` maps exact source snippets (each must occur once) to substitutes, to
    make deliberately broken variants. Reads vLLM's source without importing vLLM.
    """
    spec = importlib.util.find_spec("vllm.model_executor.models")
    src = (Path(spec.submodule_search_locations[0]) / f"{name}.py").read_text()
    src = re.sub(
        r"^(\s*)from \.(\w+) import",
        r"\1from vllm.model_executor.models.\2 import",
        src,
        flags=re.MULTILINE,
    )
    for old, new in (replace or {}).items():
        if src.count(old) != 1:
            raise ValueError(f"snippet not exactly once in vLLM's {name}.py: {old!r}")
        src = src.replace(old, new)
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(src)
    return dst


# --------------------------------------------------------------------------- in-process runs


def hf_model(ckpt: Path, dtype: str = "float32") -> Any:
    """The checkpoint's Hugging Face causal LM in ``dtype`` (float32 unless asked), in eval
    mode, with transformers' reference (eager) attention: soft caps and sliding windows exactly."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=getattr(torch, dtype), attn_implementation="eager").eval()


def hf_greedy(
    ckpt: Path, prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS, max_tokens: int = 16,
    dtype: str = "float32",
) -> tuple[Tokens, Logprobs]:
    """Greedy tokens and their logprobs from Hugging Face ``generate`` (float32).

    Each prompt runs alone (no padding). EOS does not stop generation, as with
    vLLM's ``ignore_eos=True``; logprobs come from the raw logits.
    """
    import torch

    model = hf_model(ckpt, dtype)
    gen_config = model.generation_config
    gen_config.eos_token_id = None
    gen_config.pad_token_id = 0
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
            lps = [
                torch.log_softmax(step[0].float(), -1)[tok].item()
                for step, tok in zip(out.logits, new)
            ]
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
    try:
        yield True
    finally:
        loader_utils._MODEL_ARCH_BY_HASH.clear()
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
    cls = (
        load_generated_class(generated_module, architecture)
        if generated_module
        else None
    )
    with (
        contextlib.nullcontext(True)
        if as_registered
        else _registered(architecture, cls)
    ) as available:
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
    options = {"dtype": "float32", **(llm_kwargs or {})}
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
    outs = llm.generate(
        [{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False
    )
    t2 = time.perf_counter()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [
        [pos[tok].logprob for pos, tok in zip(o.outputs[0].logprobs, toks)]
        for o, toks in zip(outs, tokens)
    ]
    # A module-level function: with tensor parallelism it is pickled to the workers.
    facts = llm.apply_model(_model_facts)[0]
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
        "num_moe_layers": model.num_moe_layers
        if is_mixture_of_experts(model)
        else None,
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

    Decoder layers are the longest ``nn.ModuleList`` whose name ends in ``layers``.
    A module counts under the first kind found in its class's MRO, so a subclass of
    ``QKVParallelLinear`` counts as QKV, not as ``ColumnParallelLinear``.
    """
    from torch import nn

    lists = [
        mod
        for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList) and name.split(".")[-1].endswith("layers")
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


# --------------------------------------------------------------------------- subprocess


def run_worker(
    runs: Sequence[dict[str, Any]],
    timeout: float = 900,
    env: dict[str, str] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Execute ``runs`` in one ``hfrewrite.verify.worker`` subprocess.

    Each run is ``{"kind": "hf" | "vllm", "ckpt", "prompts", "max_tokens",
    "generated_module", "architecture"}``, vLLM runs optionally with
    ``"as_registered": true`` and ``"llm_kwargs": {...}`` (see ``vllm_run``). ``env``
    overrides the worker's environment (``PYTHONPATH`` for a plugin or a vLLM tree,
    ``VLLM_CPU_OMP_THREADS_BIND`` for tensor parallelism). Returns one result per run
    (``{"error": ...}`` for a run that raised or never ran) and worker info
    (``import_s``, ``wall_s``, ``returncode``, ``stderr_tail``, ``mq_connect_ips``).
    """
    with tempfile.TemporaryDirectory(prefix="hfrewrite-verify-") as tmp:
        tmp = Path(tmp)
        job, out = tmp / "job.json", tmp / "out.json"
        job.write_text(json.dumps({"runs": list(runs)}, default=str))
        env = {
            **os.environ,
            **{
                k: v
                for k, v in vllm_env(tmp / "vllm-cache").items()
                if k not in os.environ
            },
            **(env or {}),
        }
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "hfrewrite.verify.worker", str(job), str(out)],
                check=False,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            rc, stderr = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            out_err = (exc.stdout or b"") + (exc.stderr or b"")  # bytes, even if text
            if isinstance(out_err, bytes):
                out_err = out_err.decode(errors="replace")
            rc, stderr = None, f"{out_err}\nworker timed out after {timeout} s"
        wall = time.perf_counter() - t0
        data = json.loads(out.read_text()) if out.exists() else {}
    results = data.get("results") or [None] * len(runs)
    tail = stderr[-4000:]
    if os.environ.get("HFREWRITE_WORKER_LOG"):  # the whole log, e.g. a worker's native stack
        Path(os.environ["HFREWRITE_WORKER_LOG"]).write_text(stderr)
    missing = {"error": f"worker exited ({rc}) before this run:\n{tail}"}
    results = [missing if r is None else r for r in results]
    info = {
        "import_s": data.get("import_s"),
        "wall_s": wall,
        "returncode": rc,
        "stderr_tail": tail,
        # where multi-process runs' message queues connected (vLLM logs it)
        "mq_connect_ips": sorted(set(re.findall(r"mq_connect_ip=([\w.:]+)", stderr))),
    }
    return results, info


class VllmServer:
    """One long-lived vLLM worker process for many runs (vLLM imported once): what the
    config fuzzer uses. ``run`` sends one vLLM run (the ``run_worker`` dict without
    ``kind``) and returns its result; vLLM's own output goes to ``log``."""

    def __init__(self, log: Path, env: dict[str, str] | None = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="hfrewrite-vllm-server-")
        read, write = os.pipe()
        env = {**os.environ, **{k: v for k, v in vllm_env(Path(self._tmp.name) / "vllm-cache").items()
                                if k not in os.environ}, **(env or {})}
        self._log = open(log, "w")  # noqa: SIM115  (closed in close())
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "hfrewrite.verify.worker", "--serve", str(write)],
            stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, text=True,
            env=env, pass_fds=(write,),
        )
        os.close(write)
        self._results = os.fdopen(read)

    def run(self, run: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
        self._proc.stdin.write(json.dumps(run, default=str) + "\n")
        self._proc.stdin.flush()
        ready, _, _ = select.select([self._results], [], [], timeout)
        line = self._results.readline() if ready else ""
        if not line:
            self.close()
            return {"error": f"the vLLM worker {'timed out' if not ready else 'exited'}; see {self._log.name}"}
        return json.loads(line)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._results.close()
        self._log.close()
        self._tmp.cleanup()


# --------------------------------------------------------------------------- verify


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of proving one generated model file on one checkpoint.

    Token/logprob fields are per prompt. ``native_*`` are None when vLLM has no
    native implementation of ``architecture``; ``logprob_diff_*`` are max |diff|
    of the chosen-token logprobs over the prefix where the tokens agree.
    """

    ckpt: str
    architecture: str
    generated_module: str
    hf_tokens: Tokens | None
    generated_tokens: Tokens | None
    native_tokens: Tokens | None
    logprob_diff_native: float | None
    logprob_diff_hf: float | None
    generated_structure: list[dict[str, int]] | None
    native_structure: list[dict[str, int]] | None
    generated_class: str | None
    ok: bool
    problems: tuple[str, ...] = ()
    generated_facts: dict[str, Any] = field(
        default_factory=dict
    )  # supports_pp, num_moe_layers
    errors: dict[str, str] = field(default_factory=dict)  # run -> traceback text
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def structure_matches_native(self) -> bool | None:
        """Same per-layer linear-layer counts as vLLM's native model (None: no native)."""
        if self.native_structure is None or self.generated_structure is None:
            return None
        return self.generated_structure == self.native_structure

    def summary(self) -> str:
        """One paragraph for humans."""
        verdict = "OK" if self.ok else "FAILED"
        n = len(self.hf_tokens or [])
        parts = [
            f"{verdict}: {Path(self.generated_module).name} as {self.architecture} "
            + f"on {self.ckpt}, {n} prompts."
        ]
        if self.native_tokens is None:
            parts.append("vLLM has no native implementation to compare with.")

        def fmt(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.2e}"

        parts.append(
            f"max |logprob diff| vs native {fmt(self.logprob_diff_native)}, "
            f"vs HF {fmt(self.logprob_diff_hf)} (tolerance {LOGPROB_TOL:g})."
        )
        if self.generated_structure:
            parts.append(
                f"Decoder layer 0 linears: {_nonzero(self.generated_structure)}"
            )
            if self.structure_matches_native is False:
                parts.append(f"(native: {_nonzero(self.native_structure)}).")
            elif self.structure_matches_native:
                parts.append("(same as native).")
        if self.problems:
            parts.append("Problems: " + "; ".join(self.problems) + ".")
        if self.timings:
            parts.append(
                "Timings: "
                + ", ".join(f"{k} {v:.1f}s" for k, v in self.timings.items())
            )
        return " ".join(parts)


def _nonzero(structure: list[dict[str, int]]) -> dict[str, int]:
    return {k: v for k, v in structure[0].items() if v} if structure else {}


@dataclass(frozen=True)
class VerifyCase:
    """One (checkpoint, generated file) pair for ``verify_many``."""

    ckpt: Path
    generated_module: Path
    architecture: str | None = None
    prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS
    max_tokens: int = 16
    dtype: str = "float32"  # both sides compute in it


def _max_diff(toks_a, lps_a, toks_b, lps_b) -> float | None:
    """Max |lp_a - lp_b| over each prompt's prefix where the tokens agree."""
    diffs = []
    for ta, la, tb, lb in zip(toks_a, lps_a, toks_b, lps_b):
        for x, y, p, q in zip(ta, tb, la, lb):
            if x != y:
                break
            diffs.append(abs(p - q))
    return max(diffs) if diffs else None


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first step where two greedy sequences differ (the shorter one's length when it is
    a prefix of the other), None when they are equal."""
    if list(a) == list(b):
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _first_mismatch(name: str, got: Tokens, want: Tokens) -> str | None:
    for i, (g, w) in enumerate(zip(got, want)):
        if (j := first_difference(g, w)) is not None:
            return f"prompt {i}: tokens differ from {name} at step {j} ({g[j : j + 3]} vs {w[j : j + 3]})"
    if len(got) != len(want):
        return f"{len(got)} outputs vs {len(want)} from {name}"
    return None


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else text


def _report(
    case: VerifyCase, arch: str, hf: dict, gen: dict, nat: dict | None, worker: dict
) -> VerifyReport:
    """Judge one case from its three run results (``nat`` None: no native class)."""
    errors = {
        what: r["error"]
        for what, r in (("hf", hf), ("generated", gen), ("native", nat or {}))
        if "error" in r
    }
    problems = [f"{what} run failed: {_last_line(err)}" for what, err in errors.items()]
    hf_ok, gen_ok = "error" not in hf, "error" not in gen
    nat_ok = nat is not None and "error" not in nat
    diff_native = diff_hf = None
    if gen_ok:
        if not gen["model_class"].startswith("hfrewrite_generated_"):
            problems.append(f"vLLM ran {gen['model_class']}, not the generated class")
        if nat_ok and not nat["model_class"].startswith("vllm.model_executor.models."):
            problems.append(f"native run used {nat['model_class']}, not vLLM's class")
        refs = [("HF", hf)] if hf_ok else []
        refs += [("native", nat)] if nat_ok else []
        for name, ref in refs:
            if msg := _first_mismatch(name, gen["tokens"], ref["tokens"]):
                problems.append(msg)
        if hf_ok:
            diff_hf = _max_diff(
                gen["tokens"], gen["logprobs"], hf["tokens"], hf["logprobs"]
            )
        if nat_ok:
            diff_native = _max_diff(
                gen["tokens"], gen["logprobs"], nat["tokens"], nat["logprobs"]
            )
        for name, diff in (("native", diff_native), ("HF", diff_hf)):
            if diff is not None and diff > LOGPROB_TOL:
                problems.append(f"logprobs differ from {name} by {diff:.2e}")
    timings = {}
    for name, r in (("hf", hf), ("generated", gen), ("native", nat or {})):
        for key in ("seconds", "init_s", "gen_s"):
            if key in r:
                timings[f"{name}_{key}"] = r[key]
    for key in ("import_s", "wall_s"):
        if worker.get(key) is not None:
            timings[f"worker_{key}"] = worker[key]
    return VerifyReport(
        ckpt=str(case.ckpt),
        architecture=arch,
        generated_module=str(case.generated_module),
        hf_tokens=hf.get("tokens"),
        generated_tokens=gen.get("tokens"),
        native_tokens=nat.get("tokens") if nat_ok else None,
        logprob_diff_native=diff_native,
        logprob_diff_hf=diff_hf,
        generated_structure=gen.get("structure"),
        native_structure=nat.get("structure") if nat_ok else None,
        generated_class=gen.get("model_class"),
        generated_facts={k: gen.get(k) for k in ("supports_pp", "num_moe_layers")},
        ok=not problems,
        problems=tuple(problems),
        errors=errors,
        timings=timings,
    )


def verify_many(
    cases: Sequence[VerifyCase], timeout: float | None = None, native: bool = True
) -> list[VerifyReport]:
    """Verify several cases in one worker process (vLLM imported once).

    Per case: HF ``generate``, vLLM with the generated file, vLLM native (unless
    ``native`` is False: then HF is the only reference). HF and native runs shared by
    several cases (same checkpoint, prompts, length) run once.
    ``timeout`` (seconds, whole batch) defaults to 120 + 30 per run.
    """
    runs: list[dict[str, Any]] = []
    index: dict[str, int] = {}

    def add(run: dict[str, Any]) -> int:
        key = json.dumps(run, sort_keys=True)
        if key not in index:
            index[key] = len(runs)
            runs.append(run)
        return index[key]

    plan = []
    for case in cases:
        arch = case.architecture or checkpoint_architecture(case.ckpt)
        common = {
            "ckpt": str(case.ckpt),
            "prompts": [list(p) for p in case.prompts],
            "max_tokens": case.max_tokens,
            "architecture": arch,
        }
        if case.dtype != "float32":
            common["dtype"] = case.dtype
        hf = add({"kind": "hf", **common, "generated_module": None})
        engine = {"llm_kwargs": {"dtype": case.dtype}} if case.dtype != "float32" else {}
        gen = add(
            {"kind": "vllm", **common, **engine, "generated_module": str(case.generated_module)}
        )
        nat = add({"kind": "vllm", **common, "generated_module": None}) if native else None
        plan.append((case, arch, hf, gen, nat))
    if timeout is None:
        timeout = 120 + 30 * len(runs)  # measured: ~5 s per vLLM run, 2 busy cores
    results, info = run_worker(runs, timeout)
    reports = []
    for case, arch, hf, gen, nat in plan:
        native = None if nat is None or results[nat].get("unsupported") else results[nat]
        reports.append(_report(case, arch, results[hf], results[gen], native, info))
    return reports


def verify_against_hf(case: VerifyCase, hf: dict[str, Any], timeout: float | None = None,
                      record: Path | None = None) -> VerifyReport:
    """Run ``case``'s generated file in a vLLM worker and judge it against ``hf``
    (``{"tokens", "logprobs"}`` computed by the caller, e.g. from a patched source);
    ``record``: see ``vllm_run``."""
    arch = case.architecture or checkpoint_architecture(case.ckpt)
    run = {
        "kind": "vllm", "ckpt": str(case.ckpt), "prompts": [list(p) for p in case.prompts],
        "max_tokens": case.max_tokens, "architecture": arch, "generated_module": str(case.generated_module),
        "record": str(record) if record else None,
    }
    results, info = run_worker([run], 150 if timeout is None else timeout)
    return _report(case, arch, hf, results[0], None, info)


def verify(
    ckpt: Path,
    generated_module: Path,
    architecture: str | None = None,
    prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS,
    max_tokens: int = 16,
    timeout: float | None = None,
) -> VerifyReport:
    """Prove ``generated_module`` on ``ckpt``: tokens must equal HF's and vLLM
    native's, chosen-token logprobs within ``LOGPROB_TOL``. ``architecture`` defaults
    to the checkpoint's (the class name looked up in the generated file)."""
    case = VerifyCase(
        Path(ckpt), Path(generated_module), architecture, prompts, max_tokens
    )
    return verify_many([case], timeout)[0]


# --------------------------------------------------------------------------- CLI

# Tiny-checkpoint variants `hfrewrite verify` proves a file on (valid for any
# llama-like config): GQA untied, MQA tied, MHA with head_dim != hidden/heads.
CLI_VARIANTS: dict[str, dict[str, Any]] = {
    "gqa": {},
    "mqa-tied": {"num_key_value_heads": 1, "tie_word_embeddings": True},
    "mha-head-dim-64": {"num_key_value_heads": 4, "head_dim": 64},
}


def main(args: Any) -> int:
    """``hfrewrite verify MODEL_TYPE [--generated FILE]``: prove the generated file
    (generated now when not given) on ``CLI_VARIANTS`` tiny checkpoints; print one
    summary per checkpoint. Exit code 0 when all pass, 1 otherwise."""
    from hfrewrite.errors import HfrewriteError

    with tempfile.TemporaryDirectory(prefix="hfrewrite-verify-") as tmp:
        tmp = Path(tmp)
        generated = args.generated
        if generated is None:
            from hfrewrite import convert
            from hfrewrite.resolve import resolve

            result = convert.generate(resolve(args.model_type))
            generated = tmp / result.filename
            generated.write_text(result.text)
        elif not Path(generated).is_file():
            raise HfrewriteError(f"{generated}: no such file")
        cases = []
        for seed, (name, overrides) in enumerate(CLI_VARIANTS.items()):
            try:
                ckpt = make_tiny_checkpoint(
                    args.model_type, tmp / name, seed=seed, **overrides
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise HfrewriteError(
                    f"{args.model_type}: cannot build a tiny checkpoint: "
                    + str(exc).split(". ")[0][:200]
                ) from None
            cases.append(VerifyCase(ckpt, Path(generated).resolve()))
        reports = verify_many(cases)
    for name, report in zip(CLI_VARIANTS, reports):
        print(f"[{name}] {report.summary()}\n")
    print("verified" if all(r.ok for r in reports) else "FAILED")
    return 0 if all(r.ok for r in reports) else 1
