"""Shared fixtures for the model-conversion tests: tiny HF checkpoints and SmolLM2."""
from __future__ import annotations

import pytest

from hf_tiny import VARIANTS, save_tiny_hf_dir


@pytest.fixture(scope="session")
def tiny_hf_dirs(tmp_path_factory):
    """``{variant: directory}`` of tiny random HF checkpoints (with tokenizer files)."""
    root = tmp_path_factory.mktemp("tiny_hf")
    return {v: save_tiny_hf_dir(v, root / v, seed=i) for i, v in enumerate(VARIANTS)}


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct in HF format (built once into the user cache)."""
    from megaflow.models.smollm2 import ensure_smollm2

    return ensure_smollm2()
