# Quick start: `make demo` and `make test`. Every target installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast test-integration test-e2e bench clean

# Reinstall when the dependency list changes; otherwise this is a no-op.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/alignflow run configs/tiny-ppo.yaml

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m unit

test-integration: $(STAMP)
	$(PY) -m pytest -q -m integration

test-e2e: $(STAMP)
	$(PY) -m pytest -q -m e2e

bench: $(STAMP)
	$(PY) benchmarks/sft_throughput.py
	$(PY) benchmarks/preference_throughput.py --stage rm,dpo
	$(PY) benchmarks/grpo_throughput.py

clean:
	rm -rf outputs .pytest_cache
