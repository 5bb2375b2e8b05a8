"""Benchmarks: the generated file vs vLLM native vs vLLM's Transformers backend vs HF.

``python -m benchmarks.throughput [--quick] [--out docs/]`` (``make bench``), run from
the repository root, measures in one run and on the same random checkpoints:

1. throughput (output tokens/s) of greedy decoding for the generated model file in vLLM,
   vLLM's native implementation, vLLM's Transformers backend (``model_impl=
   "transformers"``) and Hugging Face ``generate``; warm-up, then ``reps`` timed runs
   interleaved across variants in balanced orders (``orders.balanced_orders``) so
   machine noise hits all alike, plus generated/native pairs while their ratio is not
   clearly >= 1; the greedy tokens of every variant are compared;
2. ``LLM()`` start-up time of the three vLLM variants (every class registered as a class
   object, so none pays vLLM's one-time model-inspection subprocess; that cost is
   measured apart);
3. GEMM calls per decoder layer, from ``torch.profiler`` (see ``gemms.is_gemm``);
4. ``hfrewrite convert`` wall time per supported model type (the types in ``golden/``),
   next to ``python -c "import torch, transformers"``;
5. all of it with ``enforce_eager=True`` and with vLLM's default torch.compile mode.

Process model: the driver (``driver.run``) never imports torch or vLLM. Each variant
runs in its own long-lived worker process (``--worker SPEC``, ``worker.py``) that answers
JSON commands on stdin with one JSON line on a private copy of stdout (everything the
libraries print goes to the worker's log). Only one worker computes at a time; the
others block on stdin. So the Transformers backend never patches the classes Hugging
Face runs with, and vLLM's per-process class caches never mix two implementations.

Writes ``<out>/benchmarks.json`` (raw samples), ``<out>/benchmarks.md`` and
``<out>/benchmarks.png``. The pure helpers (``stats``, ``gemms``, ``orders``,
``targets``, ``report``) are unit-tested without vLLM (tests/test_benchmark.py).

Modules, in the order a run uses them: ``workloads`` (checkpoints and workload sizes),
``convert`` (convert wall time), ``channel`` (the driver's end of a worker),
``worker`` (the worker process), ``budget``, ``measure`` (one model in one mode),
``driver`` (the whole run), ``stats``, ``gemms``, ``orders``, ``targets``, ``report``,
``plot``; ``__main__`` parses the command line.
"""
