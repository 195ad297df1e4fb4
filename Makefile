# The README's commands. `make test` and `make demo` install first when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
EXTRAS ?= dev,loadtest,engine

.PHONY: install test demo demo-real lint bench browser-deps promtool-deps clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

# `make demo` runs the gateway and the simulator only: the package with no extras.
$(DEMO_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $(DEMO_STAMP)

# Debian's Chromium for the dashboard's browser test (never a browser downloaded by a tool).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser-deps:
	@test -x /usr/bin/chromium || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

# promtool for the alerting rules' tests (deploy/prometheus): unpacked from Debian's
# prometheus package into .cache/promtool, never installed (so no Prometheus service is
# ever started, on any host).
PROMTOOL := .cache/promtool/usr/bin/promtool
promtool-deps:
	@command -v promtool >/dev/null || test -x $(PROMTOOL) || { \
	  $(SUDO) apt-get update -qq && mkdir -p .cache/promtool && cd .cache/promtool && \
	  apt-get download -qq prometheus && dpkg-deb -x prometheus_*.deb . && rm -f prometheus_*.deb; }

test: install browser-deps promtool-deps
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q

# Real SGLang 0.5.23 on the CPU (docs/REAL_ENGINE.md, "Real SGLang on the CPU"): its own
# venv, installed once into ~/.cache/prefix-gateway/sglang-0.5.23 (about 3 minutes, 3 GB;
# reused by later runs and by CI on this machine), then the compatibility, KV-event and
# exact-mode tests (about 4 minutes; at most two servers at a time). Not in `make test`:
# together they would reach the suite's 15-minute budget on a fresh clone (about 8 minutes
# for `make test` there, 7 for this one). .ci/run runs both.
test-sglang: install
	$(PY) -m loadtests.engine.sglang_install
	$(PY) -m pytest -q -m sglang tests/sglang

# The layering contracts (pyproject.toml [tool.importlinter], docs/ARCHITECTURE.md) run in
# both targets.
lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports --no-cache

demo: $(DEMO_STAMP)
	$(PY) -m loadtests.demo --config config/demo.yaml

# The gateway in front of real llama.cpp servers (a tiny model generated on first use).
demo-real: install
	$(PY) -m loadtests.engine.real_demo

bench: install
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) -m loadtests.bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
