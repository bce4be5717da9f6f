# Every target installs what is missing first, so `make demo` and `make test` work on a fresh machine: pip alone
# for all but `make test`, which also installs the browser its page test drives.
PYTHON ?= python3
LAUNCH ?= accelerate launch
RECIPE ?= demo
ARGS ?=
RECIPES := $(filter-out demo,$(basename $(notdir $(wildcard recipes/*.yaml))))  # demo has its own target
STAMP := .cache/installed
BROWSER_STAMP := .cache/browser-installed

.PHONY: help install browser demo test test-fast test-floors train bench list $(RECIPES)
.DEFAULT_GOAL := help

help:  ## list the targets (this text)
	@echo "make TARGET [RECIPE=name] [ARGS=\"key=value ...\"]   (PYTHON=$(PYTHON))"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/  \1\t\2/' | expand -t 14
	@echo "  <recipe>    one target per shipped recipe: $(RECIPES)"

# torch first, pinned only when absent: here that takes the local CPU wheel, and an installed CUDA torch is kept.
$(STAMP): pyproject.toml
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==2.13.0"
	$(PYTHON) -m pip install -q -e ".[dev]"
	@mkdir -p $(dir $(STAMP)) && touch $(STAMP)

# The page's browser test (tests/test_serving.py) drives Debian's chromium: installed for `make test` alone, only where
# it is missing and apt-get can (root). The demo and every other target need nothing past pip.
$(BROWSER_STAMP):
	@if ! (command -v chromium && command -v chromedriver) >/dev/null && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; fi
	@mkdir -p $(dir $(BROWSER_STAMP)) && touch $(BROWSER_STAMP)

install: $(STAMP)  ## install the package and its dev tools (pip install -e .[dev])

browser: $(BROWSER_STAMP)  ## chromium and chromedriver for the page's browser test (apt-get, as root)

# The demo's figure differs less between x86-64 CPUs when torch's own kernels, MKL's and oneDNN's take their AVX2 code
# paths (AVX-512 ones sum in another order), with one thread (recipes/demo.yaml). Read before torch starts, so set here.
DEMO_KERNELS := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2

demo: $(STAMP)  ## offline demo: fine-tune the shipped tiny ViT at 64 px, print its accuracy (README: the figures)
	$(DEMO_KERNELS) $(PYTHON) -m vit_finetune --recipe demo overwrite=true $(ARGS)

# One pytest worker per core, plus one (pytest-xdist): many tests wait on a process they started (a launcher, a killed
# run, a stalled Hub), and the extra worker fills those waits (measured: docs/recipes.md, "Testing"). Each test file
# stays on one worker, so its module fixtures are built once; files go out in collection order, longest first
# (tests/conftest.py), so the workers end together.
PYTEST_WORKERS = $(shell $(PYTHON) -c "import os; print(len(getattr(os, 'sched_getaffinity', lambda _: range(os.cpu_count()))(0)) + 1)")
PYTEST_PARALLEL ?= -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: $(STAMP) $(BROWSER_STAMP)  ## the whole test suite, one worker per core plus one
	$(PYTHON) -m pytest -q $(PYTEST_PARALLEL) $(ARGS)

test-fast: $(STAMP)  ## the tests not marked slow
	$(PYTHON) -m pytest -q -m "not slow" $(PYTEST_PARALLEL) $(ARGS)

test-floors: $(STAMP)  ## the tests that train, push and load back, each dependency at its lowest allowed version
	$(PYTHON) scripts/check_lowest_versions.py $(ARGS)

train: $(STAMP)  ## train RECIPE with accelerate launch, e.g. make train RECIPE=food101_384 ARGS="train.epochs=1"
	$(LAUNCH) -m vit_finetune --recipe $(RECIPE) $(ARGS)

bench: $(STAMP)  ## throughput benchmark (python -m vit_finetune.bench)
	$(PYTHON) -m vit_finetune.bench $(ARGS)

list: $(STAMP)  ## list the shipped recipes
	$(PYTHON) -m vit_finetune --list-recipes

# One target per shipped recipe: `make food101_384 ARGS="train.epochs=1"`.
$(RECIPES): $(STAMP)
	$(LAUNCH) -m vit_finetune --recipe $@ $(ARGS)
