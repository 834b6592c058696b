# PASSING: one Makefile for setup, tests, demo and benchmarks.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: all setup test lint demo bench-core clean

all: test

$(STAMP): host/pyproject.toml controller/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e 'host[test]' -e 'controller[test]'
	touch $(STAMP)

setup: $(STAMP)

# Runs everything that needs no BMv2; BMv2/Mininet tests skip with a reason when absent.
# pytest's exit 5 ("no tests collected") is a failure here, never a pass.
test: $(STAMP)
	$(PY) -m ruff check host controller tests bench
	$(PY) -m pytest

lint: $(STAMP)
	$(PY) -m ruff check host controller tests bench

# The main job: an aggregator and 4 worker processes on loopback, results checked.
demo: $(STAMP)
	$(VENV)/bin/passing-local --workers 4 --size 1000000 --iterations 3

bench-core: $(STAMP)
	$(PY) -m pip install --quiet -e 'host[torch]'
	$(PY) bench/core.py

clean:
	rm -rf $(VENV) build .pytest_cache
