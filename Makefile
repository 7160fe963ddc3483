PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
BUILD := build
EXPORT_DIR := $(BUILD)/export/default

.PHONY: setup export test check bench peers clean family family-micro

$(VENV)/.stamp: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "torch==2.13.0" || $(VPY) -m pip install -q "torch>=2.4,<2.15"
	$(VPY) -m pip install -q -e ".[export,serve,bench,test]"
	touch $@

setup: $(VENV)/.stamp

test: setup
	$(VPY) -m pytest -q tests
