"""Rollout layouts the colocated engine cannot serve are refused at load (before any
process starts, instead of generating with partly dummy weights), and the controller's
check of a weight sync."""
import pytest

from megaflow.config import ConfigError, load_config


def test_pipeline_parallel_generation_is_refused_at_load_with_the_key_named():
    with pytest.raises(ConfigError) as err:
        load_config("tiny_arith_grpo", ["actor.tp=1", "actor.pp=2", "rollout.pp=2"])
    assert err.value.key == "rollout.pp" and "pipeline-parallel generation is not supported" in str(err.value)


def test_non_positive_generation_tp_is_refused():
    with pytest.raises(ConfigError) as err:
        load_config("tiny_arith_grpo", ["rollout.tp=0"])
    assert err.value.key == "rollout.tp"


def test_supported_layouts_load():
    cfg = load_config("tiny_arith_grpo", ["actor.tp=1", "actor.pp=2", "rollout.pp=1"])
    assert (cfg.rollout.tp, cfg.rollout.pp) == (1, 1)


def _rank(engine_version, synced, actor, **extra):
    return {"rollout/weight_version": float(engine_version), "rollout/synced_actor_version": float(synced),
            "rollout/actor_version": float(actor), **extra}


def test_check_synced_returns_rank_0_metrics_without_the_bookkeeping():
    from megaflow.workers.actor_rollout import check_synced

    ranks = [_rank(3, 2, 2, **{"reshard/bytes_received": 10.0}), _rank(3, 2, 2, **{"reshard/bytes_received": 12.0})]
    assert check_synced(ranks) == {"rollout/weight_version": 3.0, "reshard/bytes_received": 10.0}


def test_check_synced_names_the_stale_ranks_and_disagreeing_versions():
    from megaflow.workers.actor_rollout import check_synced

    with pytest.raises(RuntimeError, match=r"ranks \[1\] do not serve the actor's current weights.*\[1\.0\].*\[2\.0\]"):
        check_synced([_rank(2, 2, 2), _rank(1, 1, 2)])
    with pytest.raises(RuntimeError, match=r"disagree on their weight version.*\{2\.0: \[0\], 3\.0: \[1\]\}"):
        check_synced([_rank(2, 2, 2), _rank(3, 2, 2)])


def _built_engine(monkeypatch, tmp_path, overrides: list[str]):
    """What ``_build_engine`` hands the vLLM engine for ``overrides`` (no process: the vLLM
    engine class is replaced by a recorder)."""
    from types import SimpleNamespace

    import megaflow.rollout.vllm_rollout as vllm_rollout
    from megaflow.workers.actor_rollout import ActorRolloutWorker
    from role_testlib import role_spec

    built = {}
    monkeypatch.setattr(vllm_rollout, "VLLMRollout", lambda engine, sampling: built.update(engine=engine,
                                                                                          sampling=sampling))
    monkeypatch.setattr("tempfile.mkdtemp", lambda prefix: str(tmp_path))
    spec = role_spec("actor", overrides)
    fake = SimpleNamespace(config=spec.config, rank=0, layout=SimpleNamespace(gen_tp_groups=[[0], [1]]),
                           eos_token_ids=(), pad_token_id=3)
    fake._engine_model_dir = lambda hf: ActorRolloutWorker._engine_model_dir(fake, hf)
    ActorRolloutWorker._build_engine(fake, spec.hf_config())
    return spec, built["engine"], built["sampling"]


def test_the_engine_is_built_from_the_config_sections(monkeypatch, tmp_path):
    """``_build_engine`` reads rollout, data, model and trainer keys as they are."""
    import json

    from megaflow.config.memory import GIB

    spec, engine, sampling = _built_engine(monkeypatch, tmp_path, [
        "rollout.response_length=6", "data.max_prompt_length=10", "rollout.top_k=5", "rollout.top_p=0.9",
        "rollout.temperature=0.7", "rollout.cpu_kv_cache_gib=2", "rollout.gpu_memory_utilization=0.3",
        "trainer.seed=17"])
    assert (engine.tp_size, engine.max_model_len, engine.dtype, engine.seed) == (1, 10 + 6, "float32", 17)
    assert engine.kv_cache_bytes == 2 * GIB and engine.gpu_memory_utilization == 0.3
    assert (sampling.response_length, sampling.temperature, sampling.top_p, sampling.top_k) == (6, 0.7, 0.9, 5)
    assert (sampling.eos_token_ids, sampling.pad_token_id, sampling.n) == ((), 3, 1)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["hidden_size"] == spec.config.model.hf_config["hidden_size"]


def test_sleep_level_and_enforce_eager_reach_the_engine(monkeypatch, tmp_path):
    """rollout.sleep_level: null is 2 when colocated (1 under split placement); rollout.enforce_eager:
    null is left to the engine (by device), a value is passed on."""
    from megaflow.config.topology import rollout_sleep_level

    split = ["resources.procs_per_node=3", "resources.pools={actor: {procs_per_node: 2}, gen: {procs_per_node: 1}}",
             "resources.placement.actor=actor", "resources.placement.rollout=gen"]

    _, engine, _ = _built_engine(monkeypatch, tmp_path, [])
    assert (engine.sleep_level, engine.enforce_eager) == (2, None)
    _, engine, _ = _built_engine(monkeypatch, tmp_path, ["rollout.sleep_level=1", "rollout.enforce_eager=false"])
    assert (engine.sleep_level, engine.enforce_eager) == (1, False)
    assert rollout_sleep_level(load_config("tiny_arith_grpo", split)) == 1
    with pytest.raises(ConfigError) as err:
        load_config("tiny_arith_grpo", split + ["rollout.sleep_level=2"])
    assert err.value.key == "rollout.sleep_level" and "split placement" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config("tiny_arith_grpo", ["rollout.sleep_level=3"])
    assert err.value.key == "rollout.sleep_level"


def test_the_actor_re_syncs_an_engine_that_discarded_its_weights(monkeypatch):
    """After a level-2 sleep the engine has no weights: the next sync pushes them again even
    though the actor has not changed (validation after a step, two generations per update)."""
    import contextlib
    from types import SimpleNamespace

    import megaflow.hybrid_engine.rollout_weights as rollout_weights
    import megaflow.hybrid_engine.transport as transport
    from megaflow.workers.actor_rollout import ActorRolloutWorker

    loads = []
    monkeypatch.setattr(rollout_weights, "iter_vllm_buckets", lambda *a, **k: iter([["bucket"]]))
    monkeypatch.setattr(transport, "load_buckets", lambda engine, buckets: loads.append(list(buckets)) or (1, 0, 0))
    engine = SimpleNamespace(weights_valid=True, sharded_param_shapes=dict)
    fake = SimpleNamespace(
        _synced_version=4, _actor_version=4, rollout=engine, spec=None, layout=SimpleNamespace(gen_tp=1),
        _gen_tp_rank=0, _gather_gen_tp=None, _before_phase=lambda kinds: None, _after_phase=lambda: None,
        resharder=SimpleNamespace(generation=lambda: contextlib.nullcontext("stats"),
                                  named_generation_tensors=lambda: iter(())))
    ActorRolloutWorker._sync_rollout_weights(fake, 1 << 20)
    assert loads == []  # same version, weights held: nothing to do
    engine.weights_valid = False  # sleep_level=2 after the last generation
    ActorRolloutWorker._sync_rollout_weights(fake, 1 << 20)
    assert loads == [[["bucket"]]] and fake._synced_version == 4
