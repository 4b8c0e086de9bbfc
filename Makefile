# Two entry points: `make demo` (install + end-to-end demo on a generated checkpoint) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO := demo-out

$(BIN)/kconvert: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

.PHONY: install demo test clean device-check
install: $(BIN)/kconvert

demo: install
	rm -rf $(DEMO)
	$(BIN)/kconvert fixture tiny-k3 $(DEMO)/tiny-k3
	$(BIN)/kconvert inspect $(DEMO)/tiny-k3
	$(BIN)/kconvert plan kimi-k3-3t --tp 8 --quant fp8 --device H200 --context 128k
	$(BIN)/kconvert shard $(DEMO)/tiny-k3 $(DEMO)/tiny-k3-tp2-fp8 --tp 2 --quant fp8
	$(BIN)/kconvert verify-files $(DEMO)/tiny-k3-tp2-fp8
	$(BIN)/kconvert load $(DEMO)/tiny-k3-tp2-fp8 --rank 1 --device auto --verify
	$(BIN)/kconvert reference $(DEMO)/tiny-k3 --out $(DEMO)/ref.safetensors --hidden-states
	$(BIN)/kconvert verify $(DEMO)/tiny-k3-tp2-fp8 --reference $(DEMO)/ref.safetensors --per-layer
	$(BIN)/python -c "from kconvert.verify.prompts import synthetic_image; synthetic_image(3, 84, 56).save('$(DEMO)/picture.png')"
	OMP_NUM_THREADS=1 $(BIN)/torchrun --nproc-per-node 2 -m engine.chat $(DEMO)/tiny-k3-tp2-fp8 \
	  --prompt "Describe the image." --image $(DEMO)/picture.png --max-new-tokens 16

test: install
	$(BIN)/pytest -x

# One prepared run on a machine with a GPU (< 8 min on H100/H200); CPU dry run: make device-check ARGS="--device cpu --quick"
device-check: install
	$(BIN)/python bench/device_check.py $(ARGS)

clean:
	rm -rf $(VENV) $(DEMO) *.egg-info
