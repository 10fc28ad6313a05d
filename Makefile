# The two commands of README.md: `make run` (sidecar + database demo) and `make test`.
# Each sets up what is missing first: a virtualenv in .venv that sees the system's
# packages, so a CUDA torch already installed is kept; otherwise the CPU torch==2.13.0.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fern-installed

.PHONY: setup run test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[all]'
	touch $(STAMP)

run: setup
	$(VENV)/bin/fern demo

test: setup
	$(PY) -m pytest -q

bench: setup
	$(VENV)/bin/fern bench

clean:
	rm -rf $(VENV)
