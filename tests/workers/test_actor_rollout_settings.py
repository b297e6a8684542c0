"""RolloutSettings validation (no processes): layouts the colocated engine cannot serve are
refused at construction instead of generating with partly dummy weights."""
import pytest

from megaflow.workers.actor_rollout import RolloutSettings


def test_pipeline_parallel_generation_is_refused_with_the_key_named():
    with pytest.raises(ValueError, match=r"gen_pp=2 \(rollout.pp\)"):
        RolloutSettings(gen_tp=1, gen_pp=2)


def test_non_positive_generation_tp_is_refused():
    with pytest.raises(ValueError, match="gen_tp must be >= 1, got 0"):
        RolloutSettings(gen_tp=0)


def test_supported_layouts_construct():
    assert RolloutSettings(gen_tp=2).gen_pp == 1
