"""Adapter-only sync into vLLM (megaflow.rollout.lora_sync) against the same engine serving hand-merged weights.

One LoRA-enabled engine (TP = 1, fp32) is started in a spawned 1-rank gloo world, runs every scenario and returns
the outputs. The reference is the same engine after a full-weight update with ``W + (alpha / r) B A`` merged by hand
in Megatron layout (tests/lora_testlib.py, independent of peft_io and lora_sync), generating without an adapter.
"""
from __future__ import annotations

import pytest
import torch
from lora_testlib import merged_hf_state_dict, random_adapter
from rollout_testlib import MAX_MODEL_LEN, left_padded_prompts, with_meta

from megaflow.rollout.sampling import SamplingConfig
from megaflow.utils.launch import run_distributed

pytestmark = pytest.mark.slow

RANK, ALPHA, STALENESS, RESPONSE_LEN = 4, 8.0, 1, 6


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _renamed(adapter, old: str, new: str):
    from megaflow.models.peft_io import PeftAdapter

    return PeftAdapter({k.replace(old, new): v for k, v in adapter.tensors.items()}, adapter.rank, adapter.alpha,
                       adapter.target_modules)


def _engine_checks(rank, world_size, model_dir, prompts, adapters_path, merged_path, shm_root):
    """Runs on the spawned rank."""
    from megaflow.models.convert import read_hf_config
    from megaflow.models.hf_mapping import ModelSpec
    from megaflow.models.peft_io import megatron_to_peft
    from megaflow.rollout.lora_sync import AdapterSync
    from megaflow.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    engine = VLLMRollout(VLLMRolloutConfig(model_dir, kv_cache_bytes=32 << 20, max_model_len=MAX_MODEL_LEN,
                                           max_num_seqs=8, max_lora_rank=RANK, max_lora_versions=STALENESS + 2),
                         SamplingConfig(eos_token_ids=(), pad_token_id=2, response_length=RESPONSE_LEN))
    spec = ModelSpec.from_hf_config(read_hf_config(model_dir))
    adapters = torch.load(adapters_path)
    greedy = with_meta(prompts, do_sample=False)
    res: dict = {"errors": {}}
    res["errors"]["too_few_slots"] = _error(lambda: AdapterSync(engine, spec, alpha=ALPHA, staleness=STALENESS + 1,
                                                                base_model=model_dir))
    sync = AdapterSync(engine, spec, alpha=ALPHA, staleness=STALENESS, base_model=model_dir, root=shm_root)
    res["dir"] = str(sync.directory)
    res["base"] = engine.generate_sequences(greedy)
    sync.sync(adapters[0], version=0)
    res["v0"] = engine.generate_sequences(greedy)
    res["dir_mode"] = oct(sync.directory.stat().st_mode & 0o777)
    res["files_after_v0"] = sorted(p.name for p in sync.directory.iterdir())  # loaded: the files are gone
    sync.sync(adapters[1], version=1)
    res["v1"] = engine.generate_sequences(greedy)
    sync.sync(adapters[2], version=2)
    res["versions"], res["engine_ids"] = sync.versions, sorted(engine.list_loras())
    res["errors"]["evicted"] = _error(lambda: sync.request_for(0))
    engine.set_lora_request(sync.request_for(1))  # an older kept version still serves
    res["v1_again"] = engine.generate_sequences(greedy)
    sync.sync(adapters[0], version=2)  # a retried sync: version 2 reloaded in place with adapter 0
    res["v2_inplace"] = engine.generate_sequences(greedy)
    res["engine_ids_inplace"] = sorted(engine.list_loras())

    good = megatron_to_peft(adapters[1], spec, alpha=ALPHA)
    res["errors"]["wrong_name"] = _error(lambda: sync.publish(_renamed(good, ".q_proj.", ".q_prj."), 3))
    res["errors"]["wrong_layer"] = _error(
        lambda: sync.publish(_renamed(good, "layers.1.mlp.down_proj", "layers.7.mlp.down_proj"), 3))
    res["versions_after_errors"] = sync.versions
    res["engine_ids_after_errors"] = sorted(engine.list_loras())
    res["files_after_errors"] = sorted(p.name for p in sync.directory.iterdir())
    res["errors"]["old_version"] = _error(lambda: sync.sync(adapters[1], version=1))

    engine.set_lora_request(None)
    engine.update_weights(torch.load(merged_path).items(), format="hf_full")
    res["merged0"] = engine.generate_sequences(greedy)
    sync.close()
    res["dir_after_close"] = sync.directory.exists()
    return res


@pytest.fixture(scope="module")
def run(tiny_llama_dir, hf_tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_sync")
    adapters = [random_adapter(hf_tiny_llama, RANK, seed=s, scale=0.08) for s in (1, 2, 3)]
    torch.save(adapters, root / "adapters.pt")
    torch.save(merged_hf_state_dict(hf_tiny_llama, adapters[0], rank=RANK, alpha=ALPHA), root / "merged.pt")
    prompts = left_padded_prompts([5, 9, 3], width=9, seed=4)
    return run_distributed(_engine_checks, 1, tiny_llama_dir, prompts, str(root / "adapters.pt"),
                           str(root / "merged.pt"), None, timeout_s=900)[0]


def _same(a, b) -> None:
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    torch.testing.assert_close(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"], rtol=0, atol=1e-5)


def test_adapter_equals_hand_merged_weights(run):
    assert not torch.equal(run["v0"].batch["responses"], run["base"].batch["responses"])  # the adapter matters
    _same(run["v0"], run["merged0"])


def test_versions_are_kept_per_staleness_and_evicted(run):
    assert run["dir"].startswith("/dev/shm/megaflow-lora-") and run["dir_mode"] == "0o700"
    assert run["files_after_v0"] == []
    assert run["versions"] == [1, 2] and run["engine_ids"] == [2, 3]  # id = version + 1
    assert run["errors"]["evicted"].startswith("KeyError") and "kept versions [1, 2]" in run["errors"]["evicted"]
    _same(run["v1_again"], run["v1"])  # served from the engine's memory (its files are gone)
    assert not run["dir_after_close"]


def test_a_version_synced_again_is_reloaded_in_place(run):
    assert run["engine_ids_inplace"] == [2, 3]
    _same(run["v2_inplace"], run["v0"])  # version 2 now holds adapter 0


def test_rejected_or_mis_mapped_modules_are_named(run):
    errors = run["errors"]
    assert errors["wrong_name"].startswith("AdapterSyncError: vLLM rejected adapter version 3")
    assert "model.layers.0.self_attn.q_prj" in errors["wrong_name"]
    assert errors["wrong_layer"].startswith("AdapterSyncError: vLLM mis-maps adapter modules "
                                            "['model.layers.7.mlp.down_proj']")
    assert run["versions_after_errors"] == [1, 2] and run["engine_ids_after_errors"] == [2, 3]
    assert run["files_after_errors"] == []
    assert errors["too_few_slots"] == ("ValueError: AdapterSync: staleness 2 needs 4 adapter slots in the engine (3 "
                                       "kept versions and the one being loaded), it has "
                                       "VLLMRolloutConfig.max_lora_versions=3")
    assert errors["old_version"].startswith("ValueError: adapter version 1 is below the newest synced version 2")
