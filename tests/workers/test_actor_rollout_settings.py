"""Rollout layouts the colocated engine cannot serve are refused at load (before any
process starts, instead of generating with partly dummy weights), and the controller's
check of a weight sync."""
import pytest

from megaflow.config import ConfigError
from megaflow.topology import load_run


def test_pipeline_parallel_generation_is_refused_at_load_with_the_key_named():
    with pytest.raises(ConfigError) as err:
        load_run("tiny_arith_grpo", ["actor.tp=1", "actor.pp=2", "rollout.pp=2"])
    assert err.value.key == "rollout.pp" and "pipeline-parallel generation is not supported" in str(err.value)


def test_non_positive_generation_tp_is_refused():
    with pytest.raises(ConfigError) as err:
        load_run("tiny_arith_grpo", ["rollout.tp=0"])
    assert err.value.key == "rollout.tp"


def test_supported_layouts_load():
    cfg = load_run("tiny_arith_grpo", ["actor.tp=1", "actor.pp=2", "rollout.pp=1"])
    assert (cfg.rollout.tp, cfg.rollout.pp) == (1, 1)


def _rank(engine_version, synced, actor, **extra):
    from megaflow.workers.weight_sync import WeightSync

    return WeightSync(engine_version, synced, actor, figures=extra)


def test_check_synced_returns_rank_0_metrics_without_the_bookkeeping():
    from megaflow.workers.actor_rollout import check_synced

    ranks = [_rank(3, 2, 2, **{"reshard/bytes_received": 10.0}), _rank(3, 2, 2, **{"reshard/bytes_received": 12.0})]
    assert check_synced(ranks) == {"rollout/weight_version": 3.0, "reshard/bytes_received": 10.0}


def test_check_synced_names_the_stale_ranks_and_disagreeing_versions():
    from megaflow.workers.actor_rollout import check_synced

    with pytest.raises(RuntimeError, match=r"ranks \[1\] do not serve the actor's current weights.*\[1\].*\[2\]"):
        check_synced([_rank(2, 2, 2), _rank(1, 1, 2)])
    with pytest.raises(RuntimeError, match=r"disagree on their weight version.*\{2: \[0\], 3: \[1\]\}"):
        check_synced([_rank(2, 2, 2), _rank(3, 2, 2)])


def test_the_engine_is_built_from_the_config_sections(monkeypatch, tmp_path):
    """``build_engine`` reads rollout, data, model and trainer keys as they are (no process:
    the vLLM engine class is replaced by a recorder)."""
    import json

    import megaflow.rollout.vllm_rollout as vllm_rollout
    from megaflow.dryrun.memory import GIB
    from megaflow.workers.rollout_host import build_engine
    from role_testlib import role_spec

    built = {}
    monkeypatch.setattr(vllm_rollout, "VLLMRollout", lambda engine, sampling: built.update(engine=engine,
                                                                                          sampling=sampling))
    monkeypatch.setattr("tempfile.mkdtemp", lambda prefix: str(tmp_path))
    spec = role_spec("actor", ["rollout.response_length=6", "data.max_prompt_length=10", "rollout.top_k=5",
                               "rollout.top_p=0.9", "rollout.temperature=0.7", "rollout.cpu_kv_cache_gib=2",
                               "rollout.gpu_memory_utilization=0.3", "trainer.seed=17"])
    build_engine(spec.config, spec.hf_config(), rank=0, tp_group_ranks=[[0], [1]], eos_token_ids=(), pad_token_id=3)
    engine, sampling = built["engine"], built["sampling"]
    assert (engine.tp_size, engine.max_model_len, engine.dtype, engine.seed) == (1, 10 + 6, "float32", 17)
    assert engine.kv_cache_bytes == 2 * GIB and engine.gpu_memory_utilization == 0.3
    assert (sampling.response_length, sampling.temperature, sampling.top_p, sampling.top_k) == (6, 0.7, 0.9, 5)
    assert (sampling.eos_token_ids, sampling.pad_token_id, sampling.n) == ((), 3, 1)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["hidden_size"] == spec.config.model.hf_config["hidden_size"]


def _built_engine(monkeypatch, tmp_path, overrides: list[str]):
    """What ``build_engine`` hands the vLLM engine for ``overrides`` (no process: the vLLM
    engine class is replaced by a recorder)."""
    import megaflow.rollout.vllm_rollout as vllm_rollout
    from megaflow.workers.rollout_host import build_engine
    from role_testlib import role_spec

    built = {}
    monkeypatch.setattr(vllm_rollout, "VLLMRollout", lambda engine, sampling: built.update(engine=engine,
                                                                                          sampling=sampling))
    monkeypatch.setattr("tempfile.mkdtemp", lambda prefix: str(tmp_path))
    spec = role_spec("actor", overrides)
    build_engine(spec.config, spec.hf_config(), rank=0, tp_group_ranks=[[0], [1]], eos_token_ids=(), pad_token_id=3)
    return spec, built["engine"], built["sampling"]


def test_sleep_level_and_enforce_eager_reach_the_engine(monkeypatch, tmp_path):
    """rollout.sleep_level: null is 2 when colocated (1 under split placement); rollout.enforce_eager:
    null is left to the engine (by device), a value is passed on."""
    from megaflow.topology.sizes import rollout_sleep_level

    split = ["resources.procs_per_node=3", "resources.pools={actor: {procs_per_node: 2}, gen: {procs_per_node: 1}}",
             "resources.placement.actor=actor", "resources.placement.rollout=gen"]

    _, engine, _ = _built_engine(monkeypatch, tmp_path, [])
    assert (engine.sleep_level, engine.enforce_eager) == (2, None)
    _, engine, _ = _built_engine(monkeypatch, tmp_path, ["rollout.sleep_level=1", "rollout.enforce_eager=false"])
    assert (engine.sleep_level, engine.enforce_eager) == (1, False)
    assert rollout_sleep_level(load_run("tiny_arith_grpo", split)) == 1
    with pytest.raises(ConfigError) as err:
        load_run("tiny_arith_grpo", split + ["rollout.sleep_level=2"])
    assert err.value.key == "rollout.sleep_level" and "split placement" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_run("tiny_arith_grpo", ["rollout.sleep_level=3"])
    assert err.value.key == "rollout.sleep_level"


def test_the_actor_re_syncs_an_engine_that_discarded_its_weights(monkeypatch):
    """After a level-2 sleep the engine has no weights: the next sync pushes them again even
    though the actor has not changed (validation after a step, two generations per update)."""
    from types import SimpleNamespace

    from role_testlib import role_spec

    import megaflow.hybrid_engine.rollout_weights as rollout_weights
    from megaflow.workers.megatron_role import MegatronRole
    from megaflow.workers.weight_sync import ActorWeightSync

    class Transport:  # records what the one sync loop sends
        def __init__(self):
            self.sent, self.unchanged = [], []

        def send(self, buckets, version):
            self.sent.append((list(buckets), version))
            return "stats"

        def send_unchanged(self, version):
            self.unchanged.append(version)

    monkeypatch.setattr(rollout_weights, "generation_buckets", lambda *a, **k: iter([["bucket"]]))
    engine, sent = SimpleNamespace(weights_valid=True), Transport()
    actor = MegatronRole(role_spec("actor"))
    actor.engine = SimpleNamespace(offloaded=frozenset())
    sync = ActorWeightSync(actor, SimpleNamespace(last_stats="stats"), None, gen_tp_rank=0, adapter_route=False)
    sync.engine, sync.transport, sync.vllm_shapes = engine, sent, {}
    for _ in range(4):
        sync.actor_changed()
    sync.synced_version = 4
    sync.sync(1 << 20)
    assert sent.sent == [] and sent.unchanged == [4]  # same version, weights held: nothing to do
    engine.weights_valid = False  # sleep_level=2 after the last generation
    sync.sync(1 << 20)
    assert sent.sent == [([["bucket"]], 4)] and sync.synced_version == 4 and sync.num_sends == 1


@pytest.mark.parametrize("mode", ["processed", "raw"])
def test_logprobs_mode_reaches_the_engine_and_the_trainers_log_probs(monkeypatch, tmp_path, mode):
    """``rollout.logprobs_mode``: the engine's vLLM logprobs_mode, and whether the actor's and the
    reference's log-probs (old, current, reference) are taken under the rollout's top-p/top-k."""
    from megaflow.workers.megatron_workers import rollout_sampling

    spec, engine, _ = _built_engine(monkeypatch, tmp_path, [f"rollout.logprobs_mode={mode}", "rollout.top_p=0.6",
                                                            "rollout.top_k=20"])
    assert engine.logprobs_mode == f"{mode}_logprobs"
    sampling = rollout_sampling(spec.config, {})
    truncation = (0.6, 20) if mode == "processed" else (1.0, -1)
    assert sampling == {"temperature": 1.0, "top_p": truncation[0], "top_k": truncation[1]}
    # a call's meta_info overrides the config, as for the temperature
    sampling = rollout_sampling(spec.config, {"temperature": 0.5, "top_p": 0.9})
    assert sampling["temperature"] == 0.5 and sampling["top_p"] == (0.9 if mode == "processed" else 1.0)


def test_raw_logprobs_mode_needs_temperature_1():
    with pytest.raises(ConfigError) as err:
        load_run("tiny_arith_grpo", ["rollout.logprobs_mode=raw", "rollout.temperature=0.7"])
    assert err.value.key == "rollout.logprobs_mode" and "rollout.temperature = 1" in str(err.value)


def test_a_moe_engine_returns_routed_experts_under_every_router_replay(monkeypatch, tmp_path):
    """routed_experts come back from every single-turn MoE rollout (moe/routing_agreement under
    off, R2 and R3); prefix caching is off only for R3, which replays every prompt token's routing.
    A dense model and the multi-turn agent loop get no routing."""
    import megaflow.rollout.vllm_rollout as vllm_rollout
    from megaflow.topology import load_run
    from megaflow.topology.role_spec import RoleSpec
    from megaflow.workers.rollout_host import build_engine, returns_routed_experts

    built = {}
    monkeypatch.setattr(vllm_rollout, "VLLMRollout", lambda engine, sampling: built.update(engine=engine))
    monkeypatch.setattr("tempfile.mkdtemp", lambda prefix: str(tmp_path))
    for replay, caching in (("off", True), ("R2", True), ("R3", False)):
        cfg = load_run("tiny_moe_grpo", [f"actor.router_replay={replay}"])
        build_engine(cfg, RoleSpec(cfg, "actor", 1).hf_config(), rank=0, tp_group_ranks=[[0], [1]],
                     eos_token_ids=(), pad_token_id=0)
        assert (built["engine"].return_routed_experts, built["engine"].enable_prefix_caching) == (True, caching)
    agent = load_run("tiny_moe_grpo", ["actor.router_replay=off", "rollout.agent.enabled=true"])
    assert not returns_routed_experts(agent, RoleSpec(agent, "actor", 1).hf_config())
    dense, engine, _ = _built_engine(monkeypatch, tmp_path, [])
    assert not engine.return_routed_experts and not returns_routed_experts(dense.config, dense.hf_config())
