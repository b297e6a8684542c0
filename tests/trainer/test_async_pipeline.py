"""One-step-off asynchronous training (trainer.async_rollout) on split placement.

* the staleness bound, by hand;
* with one step of staleness, a batch generated while the actor trains on the previous one
  carries the version-k policy's log-probs (``transformers`` on the version-0 weights), not
  the updated actor's;
* the tiny recipe in async mode learns (reward rises as in the synchronous split run), logs
  staleness 0 then 1 and a timeline whose generation of batch k+1 overlaps training on k;
* kill-and-resume trains on the same prompt sequence as an uninterrupted run.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megaflow.protocol import DataProto
from megaflow.single_controller.collect import GroupProtoResult
from megaflow.trainer.rollout_source import staleness_metrics

SPLIT = ["resources.procs_per_node=4", "resources.pools={actor: {procs_per_node: 2}, gen: {procs_per_node: 2}}",
         "resources.placement.actor=actor", "resources.placement.ref=actor", "resources.placement.critic=actor",
         "resources.placement.reward_model=actor", "resources.placement.rollout=gen"]


# ---------------------------------------------------------------------------- fast
def test_staleness_is_enforced_and_measured_per_sample():
    versions = torch.tensor([3, 3, 2, 3])
    assert staleness_metrics(versions, 3, 1) == {"rollout/staleness/mean": 0.25, "rollout/staleness/max": 1.0,
                                                 "rollout/staleness/min": 0.0}
    with pytest.raises(RuntimeError, match=r"trainer\.max_staleness=1: .*weight versions \[1\].*version 3"):
        staleness_metrics(torch.tensor([3, 1, 2]), 3, 1)
    with pytest.raises(RuntimeError, match=r"weight versions \[4\]"):  # from a version the actor never had
        staleness_metrics(torch.tensor([4]), 3, 1)


def test_async_mode_turns_token_level_correction_on_unless_configured():
    from megaflow.topology import load_run
    from megaflow.trainer.rollout_source import OneStepOffSource, SplitSource

    def cfg(*rc):
        return load_run("tiny_arith_grpo", [*SPLIT, "trainer.async_rollout=true",
                                            *(f"algorithm.rollout_correction.{kv}" for kv in rc)])

    default = cfg()
    assert OneStepOffSource(None, [], default).correction().is_level == "token"
    assert SplitSource(None, [], default).correction().is_level == "none"  # the synchronous source: as set
    chosen = cfg("is_level=sequence")
    assert OneStepOffSource(None, [], chosen).correction().is_level == "sequence"
    bypass = cfg("bypass=true")
    assert OneStepOffSource(None, [], bypass).correction().is_level == "none"


# ---------------------------------------------------------------------------- slow: worker groups
@pytest.mark.slow
def test_one_step_stale_batch_has_the_version_k_policys_log_probs(ray_session, tmp_path_factory):
    """Batch 1 is generated while the actor takes its first update: its rows are version 0
    and their rollout log-probs are the version-0 policy's (transformers on the initial
    weights), not the updated actor's."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "workers"))
    from test_split_placement import (ROWS, TOKENIZER, _model_dir, _prompts, _trainer_log_probs, split_config,
                                      _SEQUENCE_KEYS)

    from megaflow.trainer.roles import build_worker_groups, shutdown_worker_groups
    from megaflow.trainer.rollout_source import sync_split_weights

    model_dir = _model_dir(tmp_path_factory, tied=False)
    cfg = split_config(model_dir, 1, split=True)
    groups = build_worker_groups(cfg, TOKENIZER, total_steps=10)
    try:
        assert sync_split_weights(groups, cfg.rollout, dtype=cfg.model.dtype)["rollout/actor_version"] == 0
        batch0 = groups.rollout.generate_sequences(_prompts({"temperature": 1.0, "seed": 11})).batch
        update = DataProto.from_dict({k: batch0.batch[k] for k in _SEQUENCE_KEYS}, meta_info={"temperature": 1.0})
        update.batch["old_log_probs"] = _trainer_log_probs(groups.actor, batch0, 1.0)
        update.batch["advantages"] = torch.where(torch.arange(ROWS) % 2 == 0, 1.0, -1.0)[:, None] \
            * torch.ones_like(update.batch["old_log_probs"])
        # generation of batch 1 and the actor's update run at the same time on their pools
        pending = groups.rollout.generate_sequences_async(_prompts({"temperature": 1.0, "seed": 12}))
        updating = groups.actor.update_actor_async(update)
        batch1, _ = pending.get().batch, updating.get()
        assert batch1.batch["weight_version"].tolist() == [0] * ROWS
        updated = _trainer_log_probs(groups.actor, batch1, 1.0)  # the actor is at version 1 now
        after = sync_split_weights(groups, cfg.rollout, dtype=cfg.model.dtype)
        assert after["rollout/actor_version"] == 1 and after["rollout/weight_version"] == 2
    finally:
        shutdown_worker_groups(groups)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, mask = batch1.batch["input_ids"], batch1.batch["attention_mask"]
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=mask, position_ids=batch1.batch["position_ids"]).logits
    width = batch1.batch["responses"].shape[1]
    version0 = torch.log_softmax(logits[:, -width - 1:-1].float(), -1).gather(
        -1, batch1.batch["responses"][..., None])[..., 0]
    valid = batch1.batch["response_mask"].bool()
    rollout = batch1.batch["rollout_log_probs"]
    assert (rollout - version0).abs()[valid].max() <= 1e-5
    assert (rollout - updated).abs()[valid].max() > 1e-3  # the version-1 actor scores them differently


# ---------------------------------------------------------------------------- slow: end to end
def _train(root: Path, name: str, overrides: list[str], trained: list | None = None,
           kill_before_step: int | None = None) -> dict[int, dict]:
    """Run the tiny recipe on split placement; ``trained`` collects each trained step's prompt
    ids (hashed rows); ``kill_before_step`` makes that step raise before it trains (a kill)."""
    from megaflow.topology import load_run
    from megaflow.trainer.main import run_dir_of, train
    import megaflow.trainer.ppo_trainer as ppo
    from megaflow.trainer.ppo_trainer import RayPPOTrainer
    from megaflow.trainer.stages import prompts_of
    from megaflow.utils.tracking import read_metrics_jsonl

    cfg = load_run("tiny_arith_grpo", [f"trainer.output_dir={root}", f"trainer.experiment_name={name}",
                                          "trainer.logger=[jsonl]", "ray.num_cpus=4", *SPLIT, *overrides])
    original, check = RayPPOTrainer.train_step, ppo.check_rollout_batch

    def recording(self):
        if kill_before_step is not None and self.global_step + 1 == kill_before_step:
            raise _Killed(f"killed before step {kill_before_step}")
        return original(self)

    def checked(batch):  # the step's batch, right after the rollout source handed it over
        if trained is not None:
            trained.append([hashlib.sha1(row.numpy().tobytes()).hexdigest()[:12]
                            for row in prompts_of(batch, cfg.rollout.n).batch["input_ids"]])
        check(batch)

    RayPPOTrainer.train_step, ppo.check_rollout_batch = recording, checked
    try:
        train(cfg)
    except _Killed:
        pass
    finally:
        RayPPOTrainer.train_step, ppo.check_rollout_batch = original, check
    return {int(r["step"]): r for r in read_metrics_jsonl(run_dir_of(cfg) / "metrics.jsonl")}


class _Killed(Exception):
    pass


LEARNING_STEPS = 30
LEARNING_RUN = [f"trainer.total_steps={LEARNING_STEPS}", "trainer.test_freq=0", "trainer.save_freq=-1"]


@pytest.fixture(scope="module")
def async_learning_run(ray_session, tmp_path_factory) -> tuple[dict[int, dict], list]:
    """The async run of :data:`LEARNING_STEPS` steps: its metrics and each step's prompt ids
    (shared: the resume test compares its prompt sequence with this uninterrupted run's)."""
    trained: list = []
    metrics = _train(tmp_path_factory.mktemp("async_learning"), "async", ["trainer.async_rollout=true", *LEARNING_RUN],
                     trained=trained)
    return metrics, trained


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_async_run_learns_like_the_synchronous_one(ray_session, tmp_path, async_learning_run):
    steps = LEARNING_STEPS
    sync = _train(tmp_path, "sync", LEARNING_RUN)
    run, _ = async_learning_run  # the same run with trainer.async_rollout=true (the fixture)
    assert sorted(run) == list(range(1, steps + 1))
    # staleness per sample: the first batch is generated with the initial weights, every later
    # one with the weights of the step before
    assert run[1]["rollout/staleness/max"] == 0.0
    assert all(run[s]["rollout/staleness/min"] == run[s]["rollout/staleness/max"] == 1.0 for s in range(2, steps + 1))
    assert all(run[s]["rollout/actor_version"] == s - 1 for s in range(1, steps + 1))
    # token-level TIS is on by default in this mode; its weights move off 1 once batches are stale
    assert run[steps]["rollout_corr/weight_max"] > 1.0 + 1e-6
    # the timeline: batch k+1's generation starts before training on batch k has ended
    overlaps = [run[s + 1]["timeline/gen_start"] < run[s]["timeline/train_end"] for s in range(1, steps)]
    assert all(overlaps), overlaps
    curves = {}
    for name, metrics in (("sync", sync), ("async", run)):
        rewards = np.array([metrics[s]["critic/score/mean"] for s in range(1, steps + 1)])
        start, end = rewards[:5].mean(), rewards[-5:].mean()
        curves[name] = (start, end)
        assert end > start + 0.05 and end > 2 * start, f"{name}: reward did not rise: {rewards.round(3).tolist()}"
    # the same shape: async's gain is at least half the synchronous run's
    assert curves["async"][1] - curves["async"][0] > 0.5 * (curves["sync"][1] - curves["sync"][0]), curves


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_async_resume_trains_on_the_same_prompts(ray_session, tmp_path, async_learning_run):
    common = ["trainer.async_rollout=true", "trainer.test_freq=0", "trainer.save_freq=2", "trainer.total_steps=5"]
    # the uninterrupted run: the learning test's (the loader's order does not depend on the run's length)
    _, uninterrupted = async_learning_run
    assert len(uninterrupted) == LEARNING_STEPS
    full = uninterrupted[:5]
    first: list = []
    _train(tmp_path, "resumed", common, trained=first, kill_before_step=4)  # last checkpoint: step 2
    rest: list = []
    resumed = _train(tmp_path, "resumed", [*common, "trainer.resume=auto"], trained=rest)
    assert len(full) == 5 and len(first) == 3 and len(rest) == 3
    # the checkpoint of step 2 was taken with batch 3 in flight; the resumed run trains steps
    # 3-5 on exactly the prompts of the uninterrupted run: none lost, none repeated
    assert first == full[:3]
    assert full[:2] + rest == full
    assert len({p for batch in full for p in batch}) > len(full[0])  # the steps' prompts differ
    assert sorted(resumed)[-1] == 5


class _FakeFuture:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


class _FakeRun:
    """The loader, the sync and the rollout group a one-step-off source talks to, recorded in
    order. The rollout group stamps each batch with the actor version its engines serve (as
    RolloutWorker does); the actor's version moves when the test says it trained."""

    def __init__(self, run_seed: int, stale_by: int = 0):
        self.calls, self.actor_version, self.position, self.run_seed = [], 0, 0, run_seed
        self.stale_by = stale_by  # pretend the engines lag this many versions behind
        self.rollout = self

    # loader
    def state_dict(self):
        return {"position": self.position}

    def __iter__(self):
        while True:
            self.position += 1
            yield DataProto.from_dict({"input_ids": torch.full((2, 3), self.position),
                                       "attention_mask": torch.ones(2, 3, dtype=torch.long)})

    # the split sync (sync_split_weights)
    def sync(self, groups, rollout_cfg, *, dtype):
        self.calls.append(("sync", self.actor_version))
        self.served = self.actor_version - self.stale_by
        return {"rollout/actor_version": float(self.actor_version)}

    # the rollout group
    def generate_sequences_async(self, gen_in):
        step = int(gen_in.meta_info["seed"]) - self.run_seed * 100_003
        self.calls.append(("generate", int(gen_in.batch["input_ids"][0, 0]), step, self.served))
        rows = DataProto.from_dict({"input_ids": gen_in.batch["input_ids"],
                                    "weight_version": torch.full((len(gen_in),), self.served)})
        return _FakeFuture(GroupProtoResult(rows, [{}]))


def test_one_step_off_order_loader_state_and_staleness_bound(monkeypatch):
    from megaflow.topology import load_run
    import megaflow.trainer.rollout_source as source

    def start(max_staleness: int, stale_by: int = 0):
        cfg = load_run("tiny_arith_grpo", [*SPLIT, "trainer.async_rollout=true",
                                               f"trainer.max_staleness={max_staleness}"])
        run = _FakeRun(cfg.trainer.seed, stale_by)
        monkeypatch.setattr(source, "sync_split_weights", run.sync)
        return source.build_source(run, run, cfg), run

    src, run = start(1)
    assert isinstance(src, source.OneStepOffSource)
    for step in range(3):
        assert src.sync().actor_version == step
        batch, metrics = src.next_batch(step)
        assert int(batch.batch["input_ids"][0, 0]) == step + 1  # the batch of this step's prompts
        assert metrics["rollout/staleness/max"] == (0.0 if step == 0 else 1.0)
        run.actor_version += 1  # the update
        # a checkpoint now stores the loader from before the batch in flight (prompt step + 2)
        assert src.loader_state() == {"position": step + 1}
    # sync, then the step's batch (first step only), then the next step's batch with the new weights
    assert run.calls == [("sync", 0), ("generate", 1, 0, 0), ("generate", 2, 1, 0),
                         ("sync", 1), ("generate", 3, 2, 1), ("sync", 2), ("generate", 4, 3, 2)]

    # trainer.max_staleness is the bound: engines one version behind make the second batch two old
    def lagging_run(max_staleness: int) -> float:
        src, late = start(max_staleness, stale_by=1)
        late.actor_version = 1
        src.sync()  # the engines serve version 0, the actor is at 1
        src.next_batch(0)  # batch 1: one version old
        late.actor_version = 2
        src.sync()
        return src.next_batch(1)[1]["rollout/staleness/max"]  # batch 2: generated at 0

    with pytest.raises(RuntimeError, match=r"trainer\.max_staleness=1: .*weight versions \[0\].*version 2"):
        lagging_run(1)
    assert lagging_run(2) == 2.0
