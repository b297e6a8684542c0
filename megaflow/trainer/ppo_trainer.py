"""The PPO/GRPO controller: one training step as a short program over worker groups.

``RayPPOTrainer.train_step`` is this data flow, stage by stage::

    prompts -> repeat n -> rollout -> reward -> old log-probs -> ref log-probs -> values
            -> KL (in reward or not) -> advantages -> critic update -> actor update

Weights never pass through the controller: the step's first call,
``sync_rollout_weights``, reshards the actor's training weights into the rollout engines
(the 3D-HybridEngine). Optional stages (ReMax's greedy baseline, batch balancing, the
old-log-prob forward or its bypass, reference, critic) are ``if`` branches on the config
and on which groups exist; KL in the reward or not is the lookup ``KL_STAGES``.

Each group is typed with its protocol (:mod:`megaflow.trainer.worker_api`), whose methods
name the worker method that runs and the batch fields it reads; every call sends only
those fields (:func:`~megaflow.trainer.worker_api.inputs_for`). Anything with the
protocols' methods can stand in for a group, so the loop is tested with fake workers as
well as with real Megatron/vLLM groups.
"""
from __future__ import annotations

import math
import random
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import torch

from megaflow.protocol import DataProto
from megaflow.trainer.checkpoint import (TRAINER_STATE_FILE, CheckpointManager, read_trainer_state,
                                         write_trainer_state)
from megaflow.trainer.stages import (add_advantages, balance_batch, bypass_old_log_probs, check_rollout_batch,
                                     compute_data_metrics, kl_in_reward, rollout_correction, scores_as_rewards)
from megaflow.trainer.worker_api import (ActorRolloutGroup, CriticGroup, RefGroup, RewardModelGroup, RolloutGroup,
                                         inputs_for)

if TYPE_CHECKING:
    from megaflow.config import Config
    from megaflow.single_controller import GroupProtoResult, ResourcePool

#: The prompt tensors the rollout's outputs replace (its ``input_ids``, ``attention_mask``
#: and ``position_ids`` cover prompt and response).
ROLLOUT_REPLACES = ("input_ids", "attention_mask", "position_ids")


@dataclass
class WorkerGroups:
    """The worker groups a step talks to (None where the role is not configured), each
    typed with its protocol in :mod:`megaflow.trainer.worker_api`.

    ``resource_pools`` are released when the groups shut down. ``rollout``: the standalone
    rollout group of split placement (:class:`~megaflow.workers.rollout_worker.RolloutWorker`;
    None: the engines live in the actor's processes).
    """

    actor: ActorRolloutGroup
    ref: RefGroup | None = None
    critic: CriticGroup | None = None
    reward_model: RewardModelGroup | None = None
    resource_pools: list[ResourcePool] = field(default_factory=list)
    rollout: RolloutGroup | None = None

    def named(self) -> dict[str, Any]:
        """``{role: group}`` of the configured groups (actor, rollout, ref, critic,
        reward_model), for shutdown and for naming a dead rank."""
        return {name: group for name in ("actor", "rollout", "ref", "critic", "reward_model")
                if (group := getattr(self, name)) is not None}


@contextmanager
def _timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[f"timing_s/{name}"] = time.perf_counter() - start


def _update_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """An update's metrics from its per-DP-rank results (DP rank 0's; the engine reduces them
    over DP, so every rank returns the same values)."""
    return {k: float(v) for k, v in per_rank[0].items()}


def _rollout_metrics(per_replica: list[dict[str, float]]) -> dict[str, float]:
    """A generate call's metrics from its per-replica results: generation replica 0's
    (the sync checked that every engine serves the same weight version), with
    ``timeline/gen_start_unix`` / ``timeline/gen_end_unix`` spanning all replicas (the
    earliest start, the latest end) when the replicas report them."""
    metrics = {k: float(v) for k, v in per_replica[0].items()}
    if "timeline/gen_start_unix" in metrics:
        metrics["timeline/gen_start_unix"] = min(m["timeline/gen_start_unix"] for m in per_replica)
        metrics["timeline/gen_end_unix"] = max(m["timeline/gen_end_unix"] for m in per_replica)
    return metrics


def capture_rng_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Python, numpy and torch RNG states, for exact resume, as (JSON data, tensors).

    The JSON part holds Python's Mersenne Twister (version, 625 ints, cached gauss) and
    numpy's legacy ``RandomState`` (624 uint32 words, position, cached gaussian); the
    tensor part holds ``torch.get_rng_state()`` (a uint8 tensor). Nothing is pickled.
    """
    version, words, gauss = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state()
    data = {"python": {"version": version, "state": list(words), "gauss_next": gauss},
            "numpy": {"bit_generator": name, "key": [int(k) for k in key], "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    return data, {"torch": torch.get_rng_state()}


def restore_rng_state(data: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`capture_rng_state`.

    Raises:
        KeyError / ValueError / TypeError: a malformed state (from a damaged checkpoint).
    """
    py, nps = data["python"], data["numpy"]
    random.setstate((int(py["version"]), tuple(int(w) for w in py["state"]), py["gauss_next"]))
    np.random.set_state((str(nps["bit_generator"]), np.asarray(nps["key"], dtype=np.uint32), int(nps["pos"]),
                         int(nps["has_gauss"]), float(nps["cached_gaussian"])))
    torch.set_rng_state(tensors["torch"])


class NonFiniteMetricsError(RuntimeError):
    """A training step produced a non-finite loss or gradient norm; the run stops before
    saving it (the newest checkpoint holds the last finite state).

    Attributes:
        step: the step (1-based, as logged) whose metrics are non-finite.
        keys: ``{metric: value}`` of the offending metrics.
    """

    def __init__(self, step: int, keys: dict[str, float]) -> None:
        super().__init__(step, keys)
        self.step, self.keys = step, keys

    def __str__(self) -> str:
        listed = ", ".join(f"{k}={v}" for k, v in sorted(self.keys.items()))
        return (f"training diverged at step {self.step}: non-finite {listed}; the step was not checkpointed. "
                "Lower the learning rate (actor.optim.lr / critic.optim.lr) or set a gradient clip "
                "(optim.clip_grad), then resume from the last checkpoint (trainer.resume=auto)")


def non_finite_metrics(metrics: dict[str, float], clip_grad: dict[str, float]) -> dict[str, float]:
    """The losses (``<role>/...loss``) and gradient norms (``<role>/grad_norm``) of the
    training roles in ``metrics`` that are NaN or infinite.

    Args:
        clip_grad: ``{role: optim.clip_grad}``; a role's gradient norm is only checked when
            its clip is > 0 (megatron-core computes no norm without clipping; the engine
            then reports NaN).
    """
    bad = {}
    for key, value in metrics.items():
        role, _, name = key.partition("/")
        if role not in clip_grad or "/" in name:
            continue
        checked = name.endswith("loss") or (name == "grad_norm" and clip_grad[role] > 0)
        if checked and not math.isfinite(float(value)):
            bad[key] = float(value)
    return bad


class RayPPOTrainer:
    """Drives PPO-family training from the controller process.

    Args:
        cfg: the run's :class:`megaflow.config.Config`.
        groups: the worker groups.
        reward_fn: ``DataProto -> DataProto`` adding ``token_level_scores`` ``[B, R]``
            (rule rewards on the controller; the reward model's scores, when configured,
            are added to them).
        train_loader: resumable prompt loader: iterable of prompt DataProtos with
            ``state_dict()`` / ``load_state_dict()``.
        val_loader: optional iterable of validation prompt DataProtos.
        tracker: metrics sink with ``log(metrics, step)`` (console/JSONL/TensorBoard and the
            progress bar: :class:`megaflow.utils.tracking.Tracking`).
        checkpoints: where checkpoints go (None disables saving).
        config_yaml: the resolved config as YAML, written into every checkpoint.
    """

    def __init__(self, cfg: Config, groups: WorkerGroups, reward_fn: Callable[[DataProto], DataProto],
                 train_loader: Any, val_loader: Any = None, tracker: Any = None,
                 checkpoints: CheckpointManager | None = None, config_yaml: str | None = None):
        self.cfg = cfg
        self.groups = groups
        self.reward_fn = reward_fn
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.tracker = tracker
        self.checkpoints = checkpoints
        self.config_yaml = config_yaml
        algo = cfg.algorithm
        from megaflow.algorithms import build_kl_controller

        self.kl_ctrl = build_kl_controller(algo.kl_ctrl.type, kl_coef=algo.kl_ctrl.kl_coef,
                                           target_kl=algo.kl_ctrl.target_kl, horizon=algo.kl_ctrl.horizon)
        self.global_step = 0
        self._train_iter: Iterator[DataProto] | None = None
        from megaflow.trainer.rollout_pipeline import build_pipeline

        self.rollout_pipeline = build_pipeline(cfg)  # synchronous, or one step off (trainer.async_rollout)

    # ------------------------------------------------------------------ the step
    def train_step(self, prompts: DataProto) -> dict[str, float]:
        """One PPO/GRPO step on a batch of prompts; returns the step's metrics."""
        g, algo, t = self.groups, self.cfg.algorithm, {}
        with _timer("sync", t):  # the actor's weights -> the rollout engines; versions checked on every rank
            sync_metrics = self.rollout_pipeline.sync(self)
        with _timer("gen", t):
            batch, rollout_metrics = self.rollout_pipeline.generate(self, prompts)
        check_rollout_batch(batch)  # the layout every later worker call relies on, checked once here
        rollout_metrics.update(sync_metrics)
        if algo.adv_estimator == "remax":
            with _timer("gen_greedy", t):
                batch = self.add_greedy_baseline(prompts, batch)
        with _timer("reward", t):
            batch = self.score(batch)
        balance_metrics = {}
        if self.cfg.trainer.balance_batch:  # equal token totals per actor DP rank for every later phase
            batch, balance_metrics = balance_batch(batch, g.actor.mesh_info("actor").dp_size)
        if algo.rollout_correction.bypass:  # pi_old = pi_rollout: no old-log-prob forward
            batch = bypass_old_log_probs(batch)
        elif self.cfg.actor.on_policy_old_log_probs:  # pi_old = the update's own detached forward
            pass
        else:
            with _timer("old_log_prob", t):
                batch = batch.union(g.actor.compute_log_prob(inputs_for(ActorRolloutGroup.compute_log_prob, batch)))
        if g.ref is not None:
            with _timer("ref", t):
                batch = batch.union(g.ref.compute_ref_log_prob(inputs_for(RefGroup.compute_ref_log_prob, batch)))
        if g.critic is not None:
            with _timer("values", t):
                batch = batch.union(g.critic.compute_values(inputs_for(CriticGroup.compute_values, batch)))
        with _timer("adv", t):
            batch, metrics = KL_STAGES[bool(algo.use_kl_in_reward)](self, batch)
            batch = add_advantages(batch, algo.adv_estimator, gamma=algo.gamma, lam=algo.lam,
                                   norm_adv_by_std=algo.norm_adv_by_std)
        if g.critic is not None:
            with _timer("update_critic", t):
                metrics.update(_update_metrics(g.critic.update_critic(inputs_for(CriticGroup.update_critic,
                                                                                 batch))))
        actor_batch, correction_metrics = rollout_correction(batch, self.rollout_pipeline.correction(self.cfg),
                                                             step=self.global_step)
        metrics.update(correction_metrics)
        with _timer("update_actor", t):
            metrics.update(_update_metrics(g.actor.update_actor(inputs_for(ActorRolloutGroup.update_actor,
                                                                           actor_batch))))
        metrics.update(compute_data_metrics(batch, self.cfg.rollout.response_length))
        metrics.update(rollout_metrics)
        metrics.update(balance_metrics)
        metrics.update(t)
        num_tokens = int(batch.batch["attention_mask"].sum())
        metrics["perf/total_num_tokens"] = num_tokens
        metrics["perf/throughput_tokens_per_s"] = num_tokens / max(sum(t.values()), 1e-9)
        return metrics

    def rollout(self, prompts: DataProto, n: int, *, greedy: bool) -> DataProto:
        """Repeat each prompt ``n`` times (samples of one prompt share a ``uid``) and generate.

        Returns the prompts' non-tensor fields (and tensor fields other than
        :data:`ROLLOUT_REPLACES`) joined with the rollout's outputs (``prompts``,
        ``responses``, ``response_mask``, ``rollout_log_probs`` ``[B, R]``; ``input_ids``,
        ``attention_mask``, ``position_ids`` ``[B, S]``), ``B = n x len(prompts)``.
        """
        return self._generate(prompts, n, greedy=greedy)[0]

    def _generate(self, prompts: DataProto, n: int, *, greedy: bool) -> tuple[DataProto, dict[str, float]]:
        """:meth:`rollout` and the rollout's metrics (engine weight version, reshard figures)."""
        prompts, gen_in = self._generation_request(prompts, n, greedy=greedy)
        return self._join_rollout(prompts, self.rollout_pipeline.generate_sequences(self, gen_in), n)

    def _generation_request(self, prompts: DataProto, n: int, *, greedy: bool,
                            step: int | None = None) -> tuple[DataProto, DataProto]:
        """``(prompts with a uid per prompt, the generate call's input)``: the prompt fields
        repeated ``n`` times with the sampling parameters of ``step`` (default: the current)."""
        prompts = prompts.union(DataProto.from_dict(
            non_tensors={"uid": [uuid.uuid4().hex for _ in range(len(prompts))]})) \
            if "uid" not in prompts.non_tensor_batch else prompts
        gen_in = inputs_for(ActorRolloutGroup.generate_sequences, prompts).repeat(n, interleave=True)
        gen_in.meta_info.update(self.sampling_params(greedy=greedy, step=step))
        return prompts, gen_in

    def _join_rollout(self, prompts: DataProto, out: GroupProtoResult,
                      n: int) -> tuple[DataProto, dict[str, float]]:
        """The prompts' other fields joined with the rollout's rows (``meta_info`` dropped:
        the sampling parameters stay with the call), and the rollout's metrics."""
        rest = prompts.select(batch_keys=[k for k in prompts.batch.keys() if k not in ROLLOUT_REPLACES])
        rest = rest.repeat(n, interleave=True)
        if rest.batch is not None and len(rest.batch.keys()) == 0:
            rest.batch = None
        rows = DataProto(out.batch.batch, out.batch.non_tensor_batch, {})
        return rest.union(rows), _rollout_metrics(out.metrics)

    def sampling_params(self, *, greedy: bool, step: int | None = None) -> dict[str, Any]:
        """The rollout's sampling parameters for one call (``meta_info`` of the generate call).

        The seed changes every step so samples differ across steps but are reproducible
        (and identical on the ranks of one generation TP group) for a given run seed;
        ``step``: the step the samples are for (default the current one; one step off,
        the next step's batch is requested during the current step).
        """
        r = self.cfg.rollout
        return {"temperature": 0.0 if greedy else r.temperature, "top_p": 1.0 if greedy else r.top_p,
                "top_k": -1 if greedy else r.top_k, "response_length": r.response_length,
                "do_sample": not greedy,
                "seed": self.cfg.trainer.seed * 100_003 + (self.global_step if step is None else step)}

    def add_greedy_baseline(self, prompts: DataProto, batch: DataProto) -> DataProto:
        """ReMax (Li et al. 2023): the reward of each prompt's greedy response is its baseline."""
        greedy = self.score(self.rollout(prompts, 1, greedy=True))
        baseline = greedy.batch["token_level_scores"].sum(-1).repeat_interleave(self.cfg.rollout.n)
        return batch.union(DataProto.from_dict({"baseline_rewards": baseline}))

    def score(self, batch: DataProto, keep_reward_fields: bool = False) -> DataProto:
        """Add ``token_level_scores``: rule rewards, plus reward-model scores when configured.

        ``keep_reward_fields`` also keeps the reward function's per-sample non-tensor fields
        (``reward_score``, ``reward_acc``, ...).
        """
        scored = self.reward_fn(batch)
        extra = [k for k in scored.non_tensor_batch if k.startswith("reward_")] if keep_reward_fields else []
        if self.groups.reward_model is not None:
            rm = self.groups.reward_model.compute_rm_score(inputs_for(RewardModelGroup.compute_rm_score, batch))
            scored.batch["token_level_scores"] = scored.batch["token_level_scores"] + rm.batch["rm_scores"]
        return batch.union(scored.select(batch_keys=["token_level_scores"], non_tensor_keys=extra))

    # ------------------------------------------------------------------ the loop
    def fit(self, total_steps: int | None = None) -> dict[str, float]:
        """Train to ``total_steps`` (default ``trainer.total_steps``), validating and
        checkpointing on the cadence of ``trainer.test_freq`` / ``trainer.save_freq``.

        Returns the last step's metrics.
        """
        tr = self.cfg.trainer
        total = total_steps if total_steps is not None else tr.total_steps
        self.resume()
        last: dict[str, float] = {}
        if getattr(tr, "val_before_train", False) and self.global_step == 0 and self.val_loader is not None:
            self._log(self.validate(), self.global_step)
        while self.global_step < total:
            prompts = self.rollout_pipeline.next_prompts(self)  # one step off: the batch already in flight
            step_start = time.perf_counter()
            metrics = self.train_step(prompts)
            self.global_step += 1
            metrics["timing_s/step"] = time.perf_counter() - step_start
            metrics.update(self.rollout_pipeline.step_done())
            bad = non_finite_metrics(metrics, self._clip_grads())
            if bad:
                self._log(metrics, self.global_step)
                raise NonFiniteMetricsError(self.global_step, bad)
            is_last = self.global_step == total
            if self.val_loader is not None and _due(tr.test_freq, self.global_step, is_last, at_end_when_zero=False):
                metrics.update(self.validate())
            self._log(metrics, self.global_step)
            if self.checkpoints is not None and _due(tr.save_freq, self.global_step, is_last, at_end_when_zero=True):
                self.save_checkpoint()
            last = metrics
        return last

    def _clip_grads(self) -> dict[str, float]:
        """``{role: optim.clip_grad}`` of the roles that train (actor, critic when present)."""
        roles = {"actor": self.cfg.actor}
        if self.groups.critic is not None:
            roles["critic"] = self.cfg.critic
        return {name: float(getattr(getattr(section, "optim", None), "clip_grad", 0.0) or 0.0)
                for name, section in roles.items()}

    def next_prompts(self) -> DataProto:
        """The next prompt batch; the loader's epoch advances (reshuffled) when it runs out."""
        if self._train_iter is None:
            self._train_iter = iter(self.train_loader)
        try:
            return next(self._train_iter)
        except StopIteration:
            self._train_iter = iter(self.train_loader)
            return next(self._train_iter)

    def sync_rollout_weights(self) -> dict[str, float]:
        """Bring every rollout engine to the actor's current weights (a no-op on the workers
        when nothing changed), in buckets of ``rollout.weight_sync_bucket_mb``, verified with
        ``rollout.verify_sync``; the versions are checked on every rank
        (:func:`~megaflow.workers.actor_rollout.check_synced`). Returns rank 0's sync metrics."""
        from megaflow.workers.actor_rollout import check_synced

        r = self.cfg.rollout
        if self.groups.rollout is not None:  # split placement: broadcast to the rollout pool
            from megaflow.trainer.rollout_pipeline import sync_split_weights

            return sync_split_weights(self.groups, r, dtype=self.cfg.model.dtype)
        return check_synced(self.groups.actor.sync_rollout_weights(verify=r.verify_sync,
                                                                   bucket_mb=r.weight_sync_bucket_mb))

    def validate(self) -> dict[str, float]:
        """Score the validation prompts (greedy unless ``rollout.val_do_sample``).

        Reports the mean score overall and per data source, and the mean accuracy
        (``val/acc/...``) where the reward function returns one (GSM8K, arith).
        The engines are synced to the actor's weights first (generation never syncs).
        """
        self.sync_rollout_weights()
        greedy = not self.cfg.rollout.val_do_sample
        scored = [self.score(self.rollout(prompts, 1, greedy=greedy), keep_reward_fields=True)
                  for prompts in self.val_loader]
        if not scored:
            return {}
        batch = DataProto.concat(scored)
        scores = batch.batch["token_level_scores"].sum(-1).float()
        sources = batch.non_tensor_batch.get("data_source", np.array(["val"] * len(batch), dtype=object))
        acc = batch.non_tensor_batch.get("reward_acc")
        metrics = {"val/score/mean": scores.mean().item()}
        if acc is not None:
            metrics["val/acc/mean"] = float(np.nanmean(acc.astype(float)))
        for s in np.unique(sources):
            sel = sources == s
            metrics[f"val/score/{s}"] = scores[torch.as_tensor(sel)].mean().item()
            if acc is not None:
                metrics[f"val/acc/{s}"] = float(np.nanmean(acc[sel].astype(float)))
        return metrics

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracker is not None and metrics:
            self.tracker.log(metrics, step=step)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Save every stateful part into one atomic checkpoint directory."""
        pending = self.checkpoints.begin(self.global_step)
        parts = [TRAINER_STATE_FILE, "actor"]
        self.groups.actor.save_checkpoint(str(pending.path / "actor"))
        if self.groups.critic is not None:
            self.groups.critic.save_checkpoint(str(pending.path / "critic"))
            parts.append("critic")
        rng, rng_tensors = capture_rng_state()
        state = {"global_step": self.global_step, "kl_ctrl": self.kl_ctrl.state_dict(),
                 "train_loader": self.rollout_pipeline.loader_state(self), "rng": rng}
        write_trainer_state(pending.path, state, rng_tensors)
        if self.config_yaml is not None:
            (pending.path / "config.yaml").write_text(self.config_yaml)
        return self.checkpoints.commit(pending, required_parts=tuple(parts))

    def resume(self) -> None:
        """Restore from ``trainer.resume`` (``disable``, ``auto`` or a checkpoint path).

        The checkpoint is verified first (:meth:`CheckpointManager.verify`: checksums, no
        pickled code) unless it was verified through this manager already (the
        controller's pre-start checks, :mod:`megaflow.trainer.resume`).

        Raises:
            FileNotFoundError: ``trainer.resume`` names no complete checkpoint.
            IntegrityError: a file of the checkpoint is missing, changed or refused.
        """
        if self.checkpoints is None:
            return
        path = self.checkpoints.resolve(self.cfg.trainer.resume)
        if path is None:
            return
        self.checkpoints.verify(path)
        state, tensors = read_trainer_state(path)
        self.groups.actor.load_checkpoint(str(path / "actor"))
        if self.groups.critic is not None:
            self.groups.critic.load_checkpoint(str(path / "critic"))
        self.global_step = state["global_step"]
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.train_loader.load_state_dict(state["train_loader"])
        self._train_iter = None
        restore_rng_state(state["rng"], tensors)
        message = f"[megaflow] resumed from {path} at step {self.global_step}"
        if self.tracker is not None:
            self.tracker.write(message)  # above the progress bar, not on its line
        else:
            print(message, flush=True)


def _due(freq: int, step: int, is_last: bool, *, at_end_when_zero: bool) -> bool:
    """Cadence rule: every ``freq`` steps and after the last; 0: only after the last when
    ``at_end_when_zero`` (checkpoints) else never (validation); negative: never."""
    if freq < 0 or (freq == 0 and not at_end_when_zero):
        return False
    return is_last or (freq > 0 and step % freq == 0)


def _kl_in_reward_stage(trainer: RayPPOTrainer, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
    return kl_in_reward(batch, trainer.kl_ctrl, trainer.cfg.algorithm.kl_penalty)


def _no_kl_stage(trainer: RayPPOTrainer, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
    return scores_as_rewards(batch)


#: ``algorithm.use_kl_in_reward`` -> the stage that turns scores into rewards.
KL_STAGES = {True: _kl_in_reward_stage, False: _no_kl_stage}

__all__ = ["RayPPOTrainer", "WorkerGroups", "KL_STAGES", "capture_rng_state", "restore_rng_state",
           "NonFiniteMetricsError", "non_finite_metrics"]
