"""Fixtures for the rollout tests: a tiny random Llama saved once per session.

vLLM engines never run inside the pytest process (vLLM creates a process group, replaces
``torch.set_num_threads`` and reseeds RNGs process-wide); the tests start them in spawned
ranks through :func:`megaflow.utils.launch.run_distributed` and compare with
``transformers`` here.
"""
from __future__ import annotations

import pytest

from rollout_testlib import build_tiny_llama, load_hf


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def hf_tiny_llama(tiny_llama_dir):
    return load_hf(tiny_llama_dir)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from intra-op threads; on a shared 2-core machine OpenMP
    spin-waiting makes them 20-40x slower. Restored after each test."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
