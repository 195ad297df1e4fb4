# The README's commands. `make test` and `make demo` install first when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS ?= dev,loadtest,engine

.PHONY: install test demo lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

test: install
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

demo: install
	$(PY) -m gateway.demo --config config/demo.yaml

bench: install
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) -m loadtests.bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
