# The two commands of README.md: `make run` (sidecar + database demo) and `make test`.
# Each sets up what is missing first: a virtualenv in .venv that sees the system's
# packages, so a CUDA torch already installed is kept; otherwise the CPU torch==2.13.0.
# `make run` installs only what the demo needs (the `demo` extra); `make test` and
# `make bench` install everything (`all`: test and benchmark tools too). Each has its own
# stamp, redone when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEMO_STAMP := $(VENV)/.fern-demo-installed
ALL_STAMP := $(VENV)/.fern-all-installed
# compat: the checkout itself goes on sys.path, so `fern bench` finds the benchmark harness,
# which the package leaves out (it is not installed from a wheel).
EDITABLE := --config-settings editable_mode=compat -e

.PHONY: setup setup-demo run test bench clean

setup: $(ALL_STAMP)

setup-demo: $(DEMO_STAMP)

$(VENV)/.fern-venv:
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	touch $@

$(DEMO_STAMP): pyproject.toml $(VENV)/.fern-venv
	$(PY) -m pip install -q $(EDITABLE) '.[demo]'
	touch $@

$(ALL_STAMP): pyproject.toml $(VENV)/.fern-venv
	$(PY) -m pip install -q $(EDITABLE) '.[all]'
	touch $@

run: $(DEMO_STAMP)
	$(VENV)/bin/fern demo

test: $(ALL_STAMP)
	$(PY) -m pytest -q

bench: $(ALL_STAMP)
	$(VENV)/bin/fern bench

clean:
	rm -rf $(VENV)
