"""The controller loop with small fake worker groups: data flow, grouping, GRPO math, resume."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megaflow.protocol import DataProto
from megaflow.single_controller import GroupProtoResult
from megaflow.trainer.checkpoint import CheckpointManager
from megaflow.trainer.ppo_trainer import RayPPOTrainer, WorkerGroups
from megaflow.trainer.proxies import ActorProxy

R = 4  # response length


class FakeActor:
    """Generates response i+1 tokens long for the i-th sample; records what it was given."""

    def __init__(self):
        self.calls, self.updates, self.version = [], [], 0

    def generate_sequences(self, gen: DataProto) -> GroupProtoResult:
        self.calls.append(("generate", len(gen), dict(gen.meta_info)))
        b = len(gen)
        g = torch.Generator().manual_seed(int(gen.meta_info["seed"]))
        responses = torch.randint(3, 9, (b, R), generator=g)
        lengths = torch.randint(1, R + 1, (b,), generator=g)
        mask = (torch.arange(R)[None] < lengths[:, None]).long()
        prompts = gen.batch["input_ids"]
        am = torch.cat([gen.batch["attention_mask"], mask], -1)
        rows = DataProto.from_dict({
            "prompts": prompts, "responses": responses, "response_mask": mask,
            "input_ids": torch.cat([prompts, responses], -1), "attention_mask": am,
            "position_ids": torch.cumsum(am, -1) - 1,
            "rollout_log_probs": -torch.ones(b, R) * 0.5}, meta_info=dict(gen.meta_info))
        return GroupProtoResult(rows, [{"rollout/weight_version": float(self.version)}])

    def sync_rollout_weights(self, verify=False, bucket_mb=None):
        """One rank's view (ActorRolloutWorker.sync_rollout_weights): its engine serves the actor's version."""
        from megaflow.workers.weight_sync import WeightSync

        return [WeightSync(self.version, self.version, self.version)]

    def mesh_info(self, mesh):
        return SimpleNamespace(dp_size=2)

    def compute_log_prob(self, batch):
        self.calls.append(("log_prob", len(batch), sorted(batch.keys())))
        return DataProto.from_dict({"old_log_probs": -torch.ones(len(batch), R) * 0.5})  # = the rollout's

    def update_actor(self, batch):
        self.calls.append(("update", len(batch), sorted(batch.keys())))
        self.updates.append(batch)
        self.version += 1
        return [{"actor/pg_loss": float(self.version)}]

    def save_checkpoint(self, path):
        import os
        os.makedirs(path)
        torch.save({"version": self.version}, f"{path}/state.pt")

    def load_checkpoint(self, path):
        self.version = torch.load(f"{path}/state.pt")["version"]


class LocalGroup:
    """A worker group of one in-process fake worker: the typed proxies' calls reach its methods."""

    def __init__(self, worker):
        self.worker = worker

    def call(self, method, *args, **kwargs):
        return getattr(self.worker, method)(*args, **kwargs)

    def mesh_info(self, mesh):
        return self.worker.mesh_info(mesh)


def actor_groups(actor: FakeActor) -> WorkerGroups:
    """The fake actor behind the real actor proxy (which sends each call only its declared fields)."""
    return WorkerGroups(actor=ActorProxy(LocalGroup(actor)))


class Loader:
    """Resumable loader of 2-prompt batches with a uid-free prompt layout."""

    def __init__(self):
        self.pos = 0

    def __iter__(self):
        while True:
            i = self.pos
            self.pos += 1
            ids = torch.tensor([[0, 1, 2], [0, 2, 1]]) + i
            yield DataProto.from_dict(
                {"input_ids": ids, "attention_mask": torch.ones(2, 3, dtype=torch.long),
                 "position_ids": torch.arange(3).repeat(2, 1)},
                {"data_source": ["arith", "arith"], "ground_truth": [str(i), str(i + 1)]})

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, s):
        self.pos = s["pos"]


def reward_fn(batch: DataProto) -> DataProto:
    """Score = number of valid response tokens that are even, on the last valid token."""
    mask = batch.batch["response_mask"]
    score = ((batch.batch["responses"] % 2 == 0).long() * mask).sum(-1).float()
    out = torch.zeros(mask.shape)
    out[torch.arange(len(batch)), mask.sum(-1) - 1] = score
    return DataProto.from_dict({"token_level_scores": out})


def make_cfg(tmp_path, total_steps=3, resume="disable", balance_batch=False, filter_groups=None):
    from megaflow.config.schema import AgentConfig, FilterGroupsConfig, RolloutCorrectionConfig

    ns = SimpleNamespace
    return ns(
        algorithm=ns(adv_estimator="grpo", gamma=1.0, lam=1.0, norm_adv_by_std=True, use_kl_in_reward=False,
                     kl_penalty="k1", kl_ctrl=ns(type="fixed", kl_coef=0.001, target_kl=None, horizon=None),
                     rollout_correction=RolloutCorrectionConfig(),
                     filter_groups=filter_groups or FilterGroupsConfig()),
        rollout=ns(n=3, temperature=1.0, top_p=1.0, top_k=-1, response_length=R, val_do_sample=False,
                   verify_sync=False, weight_sync_bucket_mb=512, agent=AgentConfig()),
        actor=ns(optim=ns(clip_grad=1.0), on_policy_old_log_probs=False),
        data=ns(train_batch_size=2),  # Loader's prompts per batch
        trainer=ns(total_steps=total_steps, test_freq=0, save_freq=1, seed=7, resume=resume,
                   balance_batch=balance_batch, async_rollout=False, max_staleness=1, generations_every=2,
                   generations_count=1))


def run(tmp_path, total_steps, resume="disable", balance_batch=False, filter_groups=None):
    actor = FakeActor()
    cfg = make_cfg(tmp_path, total_steps, resume, balance_batch, filter_groups)
    trainer = RayPPOTrainer(cfg, actor_groups(actor), reward_fn,
                            Loader(), checkpoints=CheckpointManager(tmp_path / "ckpt"))
    return trainer, actor


@pytest.fixture
def step_batches(monkeypatch):
    """The controller's whole batch of every step (what the data metrics see), in order."""
    import megaflow.trainer.ppo_trainer as ppo

    seen, real = [], ppo.compute_data_metrics

    def spy(batch, *args, **kwargs):
        seen.append(batch)
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(ppo, "compute_data_metrics", spy)
    return seen


def test_step_data_flow_groups_and_grpo_advantages(tmp_path, step_batches):
    trainer, actor = run(tmp_path, total_steps=1)
    trainer.fit()
    assert [c[0] for c in actor.calls] == ["generate", "log_prob", "update"]
    assert actor.calls[0][1] == 6 and actor.calls[0][2]["do_sample"] is True
    # each call gets only the fields its worker reads, not the step's whole batch
    assert actor.calls[1][2] == ["attention_mask", "input_ids", "responses"]
    assert actor.calls[2][2] == ["advantages", "attention_mask", "input_ids", "old_log_probs", "response_mask",
                                 "responses", "rollout_log_probs"]
    batch = step_batches[0]
    assert torch.equal(batch.batch["advantages"], actor.updates[0].batch["advantages"])
    uids = batch.non_tensor_batch["uid"]
    assert len(set(uids[:3])) == 1 and len(set(uids[3:])) == 1 and uids[0] != uids[3]
    assert batch.non_tensor_batch["ground_truth"].tolist() == ["0"] * 3 + ["1"] * 3
    # GRPO by hand: (score - group mean) / (group std + eps), on every valid token
    scores = batch.batch["token_level_scores"].sum(-1)
    mask = batch.batch["response_mask"].bool()
    for rows in (slice(0, 3), slice(3, 6)):
        s = scores[rows]
        expected = (s - s.mean()) / (s.std() + 1e-6) if s.std() > 0 else torch.zeros(3)
        adv = batch.batch["advantages"][rows]
        for i in range(3):
            m = mask[rows][i]
            assert torch.allclose(adv[i][m], expected[i].expand(int(m.sum())), atol=1e-5)
            assert (adv[i][~m] == 0).all()


def test_rollout_rows_and_metrics_travel_apart():
    from megaflow.trainer.stages import join_rollout

    prompts = next(iter(Loader()))
    rows = DataProto.from_dict({k: prompts.batch[k].repeat_interleave(2, 0)
                                for k in ("input_ids", "attention_mask", "position_ids")},
                               meta_info={"seed": 3, "temperature": 1.0})
    per_replica = [{"rollout/weight_version": 2.0, "timeline/gen_start_unix": 10.0, "timeline/gen_end_unix": 14.0},
                   {"rollout/weight_version": 2.0, "timeline/gen_start_unix": 9.0, "timeline/gen_end_unix": 13.0}]
    batch, metrics = join_rollout(prompts, GroupProtoResult(rows, per_replica), 2)
    assert batch.meta_info == {}
    assert batch.non_tensor_batch["ground_truth"].tolist() == ["0", "0", "1", "1"]
    # the generate call spans the earliest replica start to the latest replica end
    assert metrics == {"rollout/weight_version": 2.0, "timeline/gen_start_unix": 9.0, "timeline/gen_end_unix": 14.0}


def test_resume_continues_exactly(tmp_path, step_batches):
    full, full_actor = run(tmp_path / "a", total_steps=4)
    full.fit()
    full_batches = list(step_batches)
    part, _ = run(tmp_path / "b", total_steps=2)
    part.fit()
    step_batches.clear()
    resumed, resumed_actor = run(tmp_path / "b", total_steps=4, resume="auto")
    resumed.fit()
    assert sorted(p.name for p in (tmp_path / "b" / "ckpt").iterdir() if p.is_dir()) == \
        [f"global_step_{i}" for i in (1, 2, 3, 4)]
    assert resumed_actor.version == 4
    assert len(step_batches) == 2
    for a, b in zip(full_batches[2:], step_batches):
        assert torch.equal(a.batch["responses"], b.batch["responses"])
        assert torch.equal(a.batch["advantages"], b.batch["advantages"])
        assert a.non_tensor_batch["ground_truth"].tolist() == b.non_tensor_batch["ground_truth"].tolist()


def test_balance_batch_gives_each_dp_rank_equal_rows_and_balanced_tokens(tmp_path, step_batches):
    from megaflow.trainer.stages import balanced_dp_order

    lengths = torch.tensor([9, 1, 8, 2, 7, 3])
    order = balanced_dp_order(lengths, 2)
    assert sorted(order.tolist()) == list(range(6))
    chunks = lengths[order].reshape(2, 3).sum(-1).tolist()
    assert sorted(chunks) == [14, 16]  # the best possible here; the batch-order split gives 18 and 12
    trainer, actor = run(tmp_path, total_steps=1, balance_batch=True)
    metrics = trainer.train_step()
    batch = actor.updates[0]
    per_rank = batch.batch["attention_mask"].sum(-1).reshape(2, 3).sum(-1)
    assert metrics["perf/dp_tokens_imbalance"] == pytest.approx(float(per_rank.max() / per_rank.float().mean()))
    assert int((per_rank[0] - per_rank[1]).abs()) <= int(batch.batch["attention_mask"].sum(-1).max())
    # the groups survive the reorder: GRPO statistics are per uid, not per position
    uids = step_batches[0].non_tensor_batch["uid"]
    assert torch.equal(step_batches[0].batch["attention_mask"], batch.batch["attention_mask"])
    assert sorted(np.unique(uids, return_counts=True)[1].tolist()) == [3, 3]


def test_filter_groups_trains_on_the_informative_groups_of_extra_rounds(tmp_path, step_batches, monkeypatch):
    """algorithm.filter_groups: every generated round is scored; the update gets the first
    train_batch_size groups whose scores vary (a hand filter over the rounds), the extra
    rounds draw new prompts with their own seeds."""
    from megaflow.config.schema import FilterGroupsConfig
    import megaflow.trainer.rollout_source as source

    rounds = []
    real_score = RayPPOTrainer.score

    def spy_score(self, batch, keep_reward_fields=False):
        out = real_score(self, batch, keep_reward_fields)
        rounds.append(out)
        return out

    monkeypatch.setattr(RayPPOTrainer, "score", spy_score)
    def reward_with_flat_groups(batch):
        """reward_fn, but the first prompt of every round scores 1 on each sample (no variance)."""
        out = reward_fn(batch)
        first = batch.non_tensor_batch["uid"] == batch.non_tensor_batch["uid"][0]
        scores = out.batch["token_level_scores"]
        scores[torch.as_tensor(first)] = 0.0
        scores[torch.as_tensor(first), 0] = 1.0
        return out

    actor = FakeActor()
    cfg = make_cfg(tmp_path, 1, filter_groups=FilterGroupsConfig(enable=True, max_extra_rounds=3))
    trainer = RayPPOTrainer(cfg, actor_groups(actor), reward_with_flat_groups, Loader(),
                            checkpoints=CheckpointManager(tmp_path / "ckpt"))
    metrics = trainer.train_step()
    gens = [c for c in actor.calls if c[0] == "generate"]
    assert len(gens) == len(rounds) >= 2  # one prompt of each 2-prompt round is flat: 2 rounds at least
    assert len({c[2]["seed"] for c in gens}) == len(gens)
    assert gens[1][2]["seed"] - gens[0][2]["seed"] == source.ROUND_SEED_STRIDE
    good = []
    for batch in rounds:
        scores = batch.batch["token_level_scores"].sum(-1)
        uids = batch.non_tensor_batch["uid"]
        for uid in dict.fromkeys(uids.tolist()):
            rows = np.nonzero(uids == uid)[0]
            if len(set(scores[rows].tolist())) > 1:
                good.append((batch, rows))
    good = good[:2]
    expected = torch.cat([b.batch["responses"][rows] for b, rows in good])
    assert torch.equal(actor.updates[0].batch["responses"], expected)
    assert step_batches[0].non_tensor_batch["ground_truth"].tolist() == \
        [g for b, rows in good for g in b.non_tensor_batch["ground_truth"][rows].tolist()]
    assert metrics["filter_groups/informative_groups"] == sum(
        len({u for u in b.non_tensor_batch["uid"]}) - 1 for b in rounds)  # all but the flat first prompt
    assert metrics["filter_groups/kept_share"] == pytest.approx(metrics["filter_groups/informative_groups"]
                                                                 / (2 * len(rounds)))
    assert "timing_s/reward" not in metrics  # scored inside the generation rounds


def test_filter_groups_cap_says_so_on_the_console(tmp_path, capsys):
    from megaflow.config.schema import FilterGroupsConfig

    def flat(batch):
        out = reward_fn(batch)
        out.batch["token_level_scores"].zero_()  # no group has any spread
        return out

    actor = FakeActor()
    cfg = make_cfg(tmp_path, 1, filter_groups=FilterGroupsConfig(enable=True, max_extra_rounds=1))
    trainer = RayPPOTrainer(cfg, actor_groups(actor), flat, Loader())
    metrics = trainer.train_step()
    assert [c[0] for c in actor.calls].count("generate") == 2 and len(actor.updates[0]) == 6
    assert metrics["filter_groups/cap_reached"] == 1.0 and metrics["filter_groups/padded_groups"] == 2.0
    assert ("step 1: 0 informative groups of 2 after 2 generation rounds "
            "(algorithm.filter_groups.max_extra_rounds=1)") in capsys.readouterr().out


def test_fit_logs_an_eta_that_reaches_zero_at_the_last_step(tmp_path):
    logged = []
    trainer, _ = run(tmp_path, total_steps=3)
    trainer.tracker = SimpleNamespace(log=lambda metrics, step: logged.append((step, dict(metrics))),
                                      write=print)
    trainer.fit()
    etas = {step: m["timing_s/eta"] for step, m in logged}
    steps = {step: m["timing_s/step"] for step, m in logged}
    assert etas[3] == 0.0
    assert etas[1] == pytest.approx(2 * steps[1]) and etas[2] == pytest.approx((steps[1] + steps[2]) / 2)

class MismatchedActor(FakeActor):
    """Old log-probs that differ from the rollout's on the first token of every response:
    log pi_old - log pi_rollout = 1.0 there, 0 elsewhere."""

    def compute_log_prob(self, batch):
        self.calls.append(("log_prob", len(batch), sorted(batch.keys())))
        old = -torch.ones(len(batch), R) * 0.5
        old[:, 0] += 1.0
        return DataProto.from_dict({"old_log_probs": old})


@pytest.mark.parametrize("scope", ["actor", "batch"])
def test_reject_scope_actor_or_whole_batch(tmp_path, step_batches, scope):
    from megaflow.config.schema import RolloutCorrectionConfig

    cfg = make_cfg(tmp_path, total_steps=1)
    # token_k1 = log(pi_rollout / pi_old) = -1 on each first token: outside [log 0.5, log 2] -> rejected
    cfg.algorithm.rollout_correction = RolloutCorrectionConfig(rs="token_k1", rs_threshold="2", reject_scope=scope)
    actor = MismatchedActor()
    trainer = RayPPOTrainer(cfg, actor_groups(actor), reward_fn, Loader(),
                            checkpoints=CheckpointManager(tmp_path / "ckpt"))
    trainer.fit()
    step, update = step_batches[0].batch, actor.updates[0].batch
    first_rejected = update["response_mask"].clone()
    assert (first_rejected[:, 0] == 0).all() and first_rejected[:, 1:].sum() > 0
    if scope == "actor":  # megaflow: the step batch keeps every token, advantages on the first tokens too
        assert (step["response_mask"][:, 0] == 1).all()
        assert step["advantages"][:, 0].abs().sum() > 0
    else:  # verl: the step batch has lost them before the advantages (GRPO writes 0 on masked tokens)
        assert torch.equal(step["response_mask"], first_rejected)
        assert (step["advantages"][:, 0] == 0).all()
