# Two entry points: `make demo` (install + end-to-end demo on a generated checkpoint) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
VLLM_VENV ?= .venv-vllm
DEMO := demo-out

$(BIN)/kconvert: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

.PHONY: install demo test test-vllm vllm-env clean device-check
install: $(BIN)/kconvert

demo: install
	rm -rf $(DEMO)
	$(BIN)/kconvert fixture tiny-k25-dsv32-trained $(DEMO)/tiny-k25-dsv32
	$(BIN)/kconvert inspect $(DEMO)/tiny-k25-dsv32
	$(BIN)/kconvert plan k25-dsv32-3t --tp 8 --quant fp8 --device H200 --context 128k
	$(BIN)/kconvert shard $(DEMO)/tiny-k25-dsv32 $(DEMO)/tiny-k25-dsv32-tp2-fp8 --tp 2 --quant fp8
	$(BIN)/kconvert verify-files $(DEMO)/tiny-k25-dsv32-tp2-fp8
	$(BIN)/kconvert load $(DEMO)/tiny-k25-dsv32-tp2-fp8 --rank 1 --device auto --verify
	$(BIN)/kconvert reference $(DEMO)/tiny-k25-dsv32 --out $(DEMO)/ref.safetensors --hidden-states
	$(BIN)/kconvert verify $(DEMO)/tiny-k25-dsv32-tp2-fp8 --reference $(DEMO)/ref.safetensors --per-layer
	$(BIN)/kconvert export $(DEMO)/tiny-k25-dsv32 $(DEMO)/tiny-k25-dsv32-w4a16 --format w4a16
	$(BIN)/kconvert verify $(DEMO)/tiny-k25-dsv32-w4a16 --reference $(DEMO)/ref.safetensors --tp 2
	$(BIN)/python -m engine.chat $(DEMO)/tiny-k25-dsv32-tp2-fp8 --complete --prompt "def main(" --max-new-tokens 48 \
	  --kv-dtype fp8

# every core a worker (pytest-xdist), a test file's tests on one worker (its module fixtures built once), the
# checkpoints, conversions and trainings shared by the workers through the run's folder (tests/conftest.py)
WORKERS ?= auto
test: install
	$(BIN)/pytest -x -n $(WORKERS) --dist loadfile --ignore=tests/vllm

# vLLM's CPU backend in its own environment (tests/vllm/requirements.txt; ~3.5 GB, minutes); one line and no error
# where it cannot be made, and tests/vllm then skip
vllm-env:
	@tools/vllm_env.sh $(PY) $(VLLM_VENV)

# exports loaded and run by vLLM itself (tests/vllm; docs/EXPORT.md "Checked by vLLM itself"); their own CI step
test-vllm: install vllm-env
	KCONVERT_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(BIN)/pytest -x tests/vllm

# One prepared run on a machine with a GPU (< 8 min on H100/H200); CPU dry run: make device-check ARGS="--device cpu --quick"
device-check: install
	$(BIN)/python tools/device_check.py $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_VENV).log $(DEMO) *.egg-info
