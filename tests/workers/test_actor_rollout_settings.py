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
