# Every target installs what is missing first, so `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
LAUNCH ?= accelerate launch
RECIPE ?= demo
ARGS ?=
RECIPES := $(filter-out demo,$(basename $(notdir $(wildcard recipes/*.yaml))))  # demo has its own target
STAMP := .cache/installed

.PHONY: install demo test test-fast train bench list $(RECIPES)

# torch first, pinned only when absent: here that takes the local CPU wheel, and an installed CUDA torch is kept.
$(STAMP): pyproject.toml
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==2.13.0"
	$(PYTHON) -m pip install -q -e ".[dev]"
	@mkdir -p $(dir $(STAMP)) && touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PYTHON) -m vit_finetune --recipe demo overwrite=true $(ARGS)

test: $(STAMP)
	$(PYTHON) -m pytest -q $(ARGS)

test-fast: $(STAMP)
	$(PYTHON) -m pytest -q -m "not slow" $(ARGS)

train: $(STAMP)
	$(LAUNCH) -m vit_finetune --recipe $(RECIPE) $(ARGS)

bench: $(STAMP)
	$(PYTHON) -m vit_finetune.bench $(ARGS)

list: $(STAMP)
	$(PYTHON) -m vit_finetune --list-recipes

# One target per shipped recipe: `make food101_384 ARGS="train.epochs=1"`.
$(RECIPES): $(STAMP)
	$(LAUNCH) -m vit_finetune --recipe $@ $(ARGS)
