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


def test_the_engine_is_built_from_the_config_sections(monkeypatch, tmp_path):
    """``_build_engine`` reads rollout, data, model and trainer keys as they are (no process:
    the vLLM engine class is replaced by a recorder)."""
    import json
    from types import SimpleNamespace

    import megaflow.rollout.vllm_rollout as vllm_rollout
    from megaflow.dryrun.memory import GIB
    from megaflow.workers.actor_rollout import ActorRolloutWorker
    from role_testlib import role_spec

    built = {}
    monkeypatch.setattr(vllm_rollout, "VLLMRollout", lambda engine, sampling: built.update(engine=engine,
                                                                                          sampling=sampling))
    monkeypatch.setattr("tempfile.mkdtemp", lambda prefix: str(tmp_path))
    spec = role_spec("actor", ["rollout.response_length=6", "data.max_prompt_length=10", "rollout.top_k=5",
                               "rollout.top_p=0.9", "rollout.temperature=0.7", "rollout.cpu_kv_cache_gib=2",
                               "rollout.gpu_memory_utilization=0.3", "trainer.seed=17"])
    fake = SimpleNamespace(config=spec.config, rank=0, layout=SimpleNamespace(gen_tp_groups=[[0], [1]]),
                           eos_token_ids=(), pad_token_id=3)
    fake._engine_model_dir = lambda hf: ActorRolloutWorker._engine_model_dir(fake, hf)
    ActorRolloutWorker._build_engine(fake, spec.hf_config())
    engine, sampling = built["engine"], built["sampling"]
    assert (engine.tp_size, engine.max_model_len, engine.dtype, engine.seed) == (1, 10 + 6, "float32", 17)
    assert engine.kv_cache_bytes == 2 * GIB and engine.gpu_memory_utilization == 0.3
    assert (sampling.response_length, sampling.temperature, sampling.top_p, sampling.top_k) == (6, 0.7, 0.9, 5)
    assert (sampling.eos_token_ids, sampling.pad_token_id, sampling.n) == ((), 3, 1)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["hidden_size"] == spec.config.model.hf_config["hidden_size"]


@pytest.mark.parametrize("mode", ["processed", "raw"])
def test_logprobs_mode_reaches_the_engine_and_the_trainers_log_probs(monkeypatch, tmp_path, mode):
    """``rollout.logprobs_mode``: the engine's vLLM logprobs_mode, and whether the actor's and the
    reference's log-probs (old, current, reference) are taken under the rollout's top-p/top-k."""
    from types import SimpleNamespace

    import megaflow.rollout.vllm_rollout as vllm_rollout
    from megaflow.workers.actor_rollout import ActorRolloutWorker
    from megaflow.workers.megatron_workers import MegatronWorker
    from role_testlib import role_spec

    built = {}
    monkeypatch.setattr(vllm_rollout, "VLLMRollout", lambda engine, sampling: built.update(engine=engine))
    monkeypatch.setattr("tempfile.mkdtemp", lambda prefix: str(tmp_path))
    spec = role_spec("actor", [f"rollout.logprobs_mode={mode}", "rollout.top_p=0.6", "rollout.top_k=20"])
    fake = SimpleNamespace(config=spec.config, rank=0, layout=SimpleNamespace(gen_tp_groups=[[0]]),
                           eos_token_ids=(), pad_token_id=3)
    fake._engine_model_dir = lambda hf: ActorRolloutWorker._engine_model_dir(fake, hf)
    ActorRolloutWorker._build_engine(fake, spec.hf_config())
    assert built["engine"].logprobs_mode == f"{mode}_logprobs"
    sampling = MegatronWorker._sampling(fake, SimpleNamespace(meta_info={}))
    truncation = (0.6, 20) if mode == "processed" else (1.0, -1)
    assert sampling == {"temperature": 1.0, "top_p": truncation[0], "top_k": truncation[1]}
    # a call's meta_info overrides the config, as for the temperature
    sampling = MegatronWorker._sampling(fake, SimpleNamespace(meta_info={"temperature": 0.5, "top_p": 0.9}))
    assert sampling["temperature"] == 0.5 and sampling["top_p"] == (0.9 if mode == "processed" else 1.0)


def test_raw_logprobs_mode_needs_temperature_1():
    with pytest.raises(ConfigError) as err:
        load_run("tiny_arith_grpo", ["rollout.logprobs_mode=raw", "rollout.temperature=0.7"])
    assert err.value.key == "rollout.logprobs_mode" and "rollout.temperature = 1" in str(err.value)
