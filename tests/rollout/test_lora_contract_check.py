"""The adapter contract check (megaflow.rollout.lora_sync.check_loaded_adapter) on what a vLLM 0.32 worker reports,
built here the way vLLM packs a PEFT adapter (q/k/v -> qkv_proj slots 0/1/2, gate/up -> gate_up_proj, B scaled),
with the mis-maps an engine upgrade could bring; and AdapterSync's refusals before it writes anything. No engine."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from lora_testlib import random_adapter, spec_of
from rollout_testlib import build_tiny_llama, load_hf

from megaflow.models.peft_io import PEFT_PREFIX, megatron_to_peft
from megaflow.rollout.lora_sync import AdapterSync, AdapterSyncError, check_loaded_adapter

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    model = load_hf(build_tiny_llama(str(tmp_path_factory.mktemp("m"))))
    return megatron_to_peft(random_adapter(model, 4, seed=1), spec_of(model), alpha=8.0)


def _held(adapter) -> dict:
    """What vLLM 0.32's worker holds for the adapter (written out independently of lora_sync)."""
    loaded: dict = {}
    for layer in range(2):
        for parent, packed, parts in (("self_attn", "qkv_proj", PACKED["qkv_proj"]), ("self_attn", "o_proj", None),
                                      ("mlp", "gate_up_proj", PACKED["gate_up_proj"]), ("mlp", "down_proj", None)):
            names = [f"model.layers.{layer}.{parent}.{p}" for p in (parts or [packed])]
            a = [adapter.tensors[f"{PEFT_PREFIX}{n}.lora_A.weight"] for n in names]
            b = [adapter.tensors[f"{PEFT_PREFIX}{n}.lora_B.weight"] * adapter.scale for n in names]
            loaded[f"model.layers.{layer}.{parent}.{packed}"] = (a, b)
    return {"loaded": loaded, "modules": sorted(loaded) + ["lm_head", "model.embed_tokens"], "packed": PACKED}


def test_a_faithful_load_passes(adapter):
    check_loaded_adapter(_held(adapter), adapter)


def test_swapped_slots_are_named(adapter):
    held = _held(adapter)
    a, b = held["loaded"]["model.layers.1.self_attn.qkv_proj"]
    held["loaded"]["model.layers.1.self_attn.qkv_proj"] = (a, [b[1], b[0], b[2]])  # q and k rows swapped
    with pytest.raises(AdapterSyncError, match=r"adapter module model\.layers\.1\.self_attn\.q_proj: vLLM's "
                                               r"model\.layers\.1\.self_attn\.qkv_proj slot 0 holds a different "
                                               r"lora_B"):
        check_loaded_adapter(held, adapter)


def test_unscaled_b_is_named(adapter):
    held = _held(adapter)
    a, b = held["loaded"]["model.layers.0.mlp.down_proj"]
    held["loaded"]["model.layers.0.mlp.down_proj"] = (a, [b[0] / adapter.scale])
    with pytest.raises(AdapterSyncError, match=r"model\.layers\.0\.mlp\.down_proj.*different lora_B"):
        check_loaded_adapter(held, adapter)


def test_missing_and_empty_slots_and_stray_modules_are_named(adapter):
    held = _held(adapter)
    del held["loaded"]["model.layers.0.self_attn.o_proj"]
    with pytest.raises(AdapterSyncError, match=r"model\.layers\.0\.self_attn\.o_proj: vLLM loaded nothing"):
        check_loaded_adapter(held, adapter)
    held = _held(adapter)
    a, b = held["loaded"]["model.layers.0.mlp.gate_up_proj"]
    held["loaded"]["model.layers.0.mlp.gate_up_proj"] = (a, [b[0], None])
    with pytest.raises(AdapterSyncError, match=r"up_proj: vLLM's model\.layers\.0\.mlp\.gate_up_proj has no "
                                               r"weights in slot 1"):
        check_loaded_adapter(held, adapter)
    held = _held(adapter)
    held["loaded"]["model.layers.9.mlp.down_proj"] = held["loaded"]["model.layers.0.mlp.down_proj"]
    with pytest.raises(AdapterSyncError, match=r"mis-maps adapter modules \['model\.layers\.9\.mlp\.down_proj'\]"):
        check_loaded_adapter(held, adapter)
    with pytest.raises(AdapterSyncError, match="does not list the adapter"):
        check_loaded_adapter({**_held(adapter), "loaded": None}, adapter)


def _engine(rank: int, versions: int) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(max_lora_rank=rank, max_lora_versions=versions))


def test_adapter_sync_refuses_an_engine_that_cannot_hold_the_versions(tmp_path):
    spec = SimpleNamespace()
    with pytest.raises(ValueError, match=r"built without LoRA \(VLLMRolloutConfig.max_lora_rank=0\)"):
        AdapterSync(_engine(0, 4), spec, alpha=8.0, base_model="b", root=tmp_path)
    with pytest.raises(ValueError, match="staleness 2 needs 4 adapter slots"):
        AdapterSync(_engine(8, 3), spec, alpha=8.0, staleness=2, base_model="b", root=tmp_path)
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        AdapterSync(_engine(8, 3), spec, alpha=8.0, staleness=-1, base_model="b", root=tmp_path)
    assert list(tmp_path.iterdir()) == []  # refused before any directory was made
