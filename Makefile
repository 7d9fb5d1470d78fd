# gdn2 development tasks. `make test` and `make demo` set everything up on a fresh machine.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PACKAGES := gdn2core conformance backends/jax_ref backends/scan_baseline backends/pallas_tpu tools
STAMP := $(VENV)/.installed
export JAX_PLATFORMS ?= cpu
# libtpu, loaded for deviceless TPU compiles, would write ~1 GB of logs per process to /tmp/tpu_logs.
export TPU_LOG_DIR ?= disabled
# Deviceless compiles load libtpu in each pytest worker; no TPU is opened, so several may load it.
export ALLOW_MULTIPLE_LIBTPU_LOAD ?= 1
export PYTHONUNBUFFERED := 1

# The first Python >= 3.12 on PATH (a .python-version file makes pyenv provide 3.12).
PYTHON_FOR_VENV ?= $(shell for p in python3.12 python3.13 python3 python; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null \
	&& { echo $$p; break; }; done)

FLOORS_VENV := .venv-floors
FLOORS_PY := $(FLOORS_VENV)/bin/python
#: The tests run against the lowest declared versions: the core, the kit, jax_ref and the layer.
FLOORS_TESTS := tests/core tests/conformance tests/jax_ref tests/scan_baseline tests/layers

.PHONY: venv test test-full test-floors test-slow test-tpu-compile lint format demo bench clean

$(PY):
	@test -n "$(PYTHON_FOR_VENV)" || { echo "need Python >= 3.12 on PATH" >&2; exit 1; }
	$(PYTHON_FOR_VENV) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml $(foreach p,$(PACKAGES),$(p)/pyproject.toml)
	$(PY) -m pip install -q --upgrade "pip>=25.1"
	$(PY) -m pip install -q --group dev
	$(PY) -m pip install -q --no-deps $(foreach p,$(PACKAGES),-e $(p))
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The quick tier (tests/tiers.py: every backend and option once), on two workers (pytest-xdist:
# the TPU interpret-mode tests are single-threaded Python).
test: lint
	$(PY) -m pytest -m "not slow and not full" -q -n 2

# The rest of the suite: the tests `make test` leaves out (tests/tiers.py), long sweeps excepted.
test-full: $(STAMP)
	$(PY) -m pytest -m "full and not slow" -q -n 2

# A second environment with every declared dependency at its floor (.ci/floors.py), installed
# from the package folders as a user would (not editable), then the quick tier of the core, the
# kit, jax_ref, scan_baseline and the layer on two workers (pytest-xdist at the dev pin). The full
# tier stays on the dev versions: interpret mode on two simulated cores
# (tests/pallas_tpu/test_races.py) crashed once inside XLA's compiler on JAX 0.11.2 (README,
# Limitations).
test-floors:
	@test -n "$(PYTHON_FOR_VENV)" || { echo "need Python >= 3.12 on PATH" >&2; exit 1; }
	rm -rf $(FLOORS_VENV)
	$(PYTHON_FOR_VENV) -m venv $(FLOORS_VENV)
	$(FLOORS_PY) -m pip install -q --upgrade "pip>=25.1"
	$(FLOORS_PY) .ci/floors.py gdn2core:flax > $(FLOORS_VENV)/constraints.txt
	cat $(FLOORS_VENV)/constraints.txt
	$(FLOORS_PY) -m pip install -q -c $(FLOORS_VENV)/constraints.txt "./gdn2core[flax]" ./conformance \
		./backends/jax_ref ./backends/scan_baseline ./backends/pallas_tpu ./tools "pytest-xdist==3.8.0"
	$(FLOORS_PY) -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|numpy|pydantic|pluggy|jaxtyping|flax|optax|pytest|rich) "
	$(FLOORS_PY) -m pytest -m "not slow and not full and not tpu_compile" -q -n 2 $(FLOORS_TESTS)

test-slow: $(STAMP)
	$(PY) -m pytest -m slow -q

# The deviceless TPU compile matrix (part of test-slow; .ci/run runs it after make test).
test-tpu-compile: $(STAMP)
	ALLOW_MULTIPLE_LIBTPU_LOAD=1 $(PY) -m pytest -m "tpu_compile and slow" -q -n 2

demo: $(STAMP)
	$(PY) examples/minimal_usage.py
	$(PY) examples/train_mqar.py
	$(PY) examples/train_mqar.py --variant kda
	$(PY) examples/train_mqar.py --variant gdn

bench: $(STAMP)
	$(VENV)/bin/gdn2 bench

clean:
	rm -rf $(VENV) $(FLOORS_VENV) bench-results .pytest_cache .ruff_cache
