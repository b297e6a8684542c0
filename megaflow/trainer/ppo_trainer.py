"""The PPO/GRPO controller: one training step as a short program over worker groups.

``RayPPOTrainer.train_step`` is this data flow, stage by stage::

    prompts -> repeat n -> rollout -> reward -> old log-probs -> ref log-probs -> values
            -> KL (in reward or not) -> advantages -> critic update -> actor update

Weights never pass through the controller: the step's first call,
``sync_rollout_weights``, reshards the actor's training weights into the rollout engines
(the 3D-HybridEngine). Optional stages (ReMax's greedy baseline, batch balancing, the
old-log-prob forward or its bypass, reference, critic) are ``if`` branches on the config
and on which groups exist; KL in the reward or not is the lookup ``KL_STAGES``.

Each role is called through its typed proxy (:mod:`megaflow.trainer.proxies`), whose
methods name the worker method that runs and the batch fields it reads; every call sends
only those fields (:func:`~megaflow.trainer.proxies.inputs_for`). A proxy over any object
with ``call``/``submit`` stands in for a Ray group, so the loop is tested with fake workers
as well as with real Megatron/vLLM groups.
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from megaflow.protocol import DataProto
from megaflow.rewards.manager import reward_metrics
from megaflow.trainer.checkpoint import TRAINER_STATE_FILE, CheckpointManager, read_trainer_state, write_trainer_state
from megaflow.trainer.dynamic_sampling import fill_informative
from megaflow.trainer.generations import TRAJECTORIES_FILE, sample_generations, write_trajectories
from megaflow.trainer.proxies import WorkerGroups
from megaflow.trainer.stages import (
    add_advantages,
    balance_batch,
    bypass_old_log_probs,
    check_rollout_batch,
    compute_data_metrics,
    kl_in_reward,
    prompts_of,
    rollout_correction,
    scores_as_rewards,
)

if TYPE_CHECKING:
    from megaflow.config import Config
    from megaflow.trainer.safe_rlhf import SafeRLHF


@contextmanager
def _timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[f"timing_s/{name}"] = time.perf_counter() - start


def _update_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """An update's metrics from its per-DP-rank results (DP rank 0's; the engine reduces them
    over DP, so every rank returns the same values)."""
    return {k: float(v) for k, v in per_rank[0].items()}


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
        decode: token ids -> text (the tokenizer's ``decode``), for the sample generations
            (``trainer.generations_*``); None: none are logged.
        safe_rlhf: Safe RLHF's cost and multiplier (:class:`megaflow.trainer.safe_rlhf.SafeRLHF`)
            with ``algorithm.safe_rlhf.enable``; needs the ``cost_critic`` group.
    """

    def __init__(self, cfg: Config, groups: WorkerGroups, reward_fn: Callable[[DataProto], DataProto],
                 train_loader: Any, val_loader: Any = None, tracker: Any = None,
                 checkpoints: CheckpointManager | None = None, config_yaml: str | None = None,
                 decode: Callable[[list[int]], str] | None = None, safe_rlhf: SafeRLHF | None = None) -> None:
        self.cfg = cfg
        self.groups = groups
        self.reward_fn = reward_fn
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.tracker = tracker
        self.checkpoints = checkpoints
        self.config_yaml = config_yaml
        self.decode = decode
        self.safe = safe_rlhf
        if (safe_rlhf is None) != (groups.cost_critic is None):
            raise ValueError("Safe RLHF needs both its cost/multiplier (safe_rlhf) and the cost_critic group")
        self.generations: list[dict[str, Any]] = []  # the last step's samples (trainer.generations_*)
        algo = cfg.algorithm
        from megaflow.algorithms import build_kl_controller

        self.kl_ctrl = build_kl_controller(algo.kl_ctrl.type, kl_coef=algo.kl_ctrl.kl_coef,
                                           target_kl=algo.kl_ctrl.target_kl, horizon=algo.kl_ctrl.horizon)
        self.global_step = 0
        from megaflow.trainer.rollout_source import build_source

        #: colocated, split or one step off (trainer.async_rollout)
        self.rollouts = build_source(groups, train_loader, cfg)

    # ------------------------------------------------------------------ the step
    def train_step(self) -> dict[str, float]:
        """One PPO/GRPO step (step ``global_step``) on the rollout source's next batch;
        returns the step's metrics."""
        g, algo = self.groups, self.cfg.algorithm
        t: dict[str, float] = {}
        with _timer("sync", t):  # the actor's weights -> the rollout engines; versions checked on every rank
            sync_metrics = self.rollouts.sync().metrics
        with _timer("gen", t):  # one step off: the batch already in flight; filter_groups: rounds and rewards
            if algo.filter_groups.enable:
                batch, rollout_metrics = self.generate_informative()
            else:
                batch, rollout_metrics = self.rollouts.next_batch(self.global_step)
        check_rollout_batch(batch)  # the layout every later worker call relies on, checked once here
        rollout_metrics.update(sync_metrics)
        if algo.adv_estimator == "remax":
            with _timer("gen_greedy", t):
                batch = self.add_greedy_baseline(batch)
        if not algo.filter_groups.enable:  # dynamic sampling scored every round already
            with _timer("reward", t):
                batch = self.score(batch)
        if self.safe is not None:  # Safe RLHF: the rule cost of every response
            batch = self.safe.add_costs(batch)
        balance_metrics: dict[str, float] = {}
        if self.cfg.trainer.balance_batch:  # equal token totals per actor DP rank for every later phase
            batch, balance_metrics = balance_batch(batch, g.actor.mesh_info("actor").dp_size)
        if algo.rollout_correction.bypass:  # pi_old = pi_rollout: no old-log-prob forward
            batch = bypass_old_log_probs(batch)
        elif self.cfg.actor.on_policy_old_log_probs:  # pi_old = the update's own detached forward
            pass
        else:
            with _timer("old_log_prob", t):
                batch = batch.union(g.actor.compute_log_prob(batch))
        if g.reference is not None:  # the reference group, or the actor's base with LoRA
            with _timer("ref", t):
                batch = batch.union(g.reference.compute_ref_log_prob(batch))
        if g.critic is not None:
            with _timer("values", t):
                batch = batch.union(g.critic.compute_values(batch))
        if self.safe is not None and g.cost_critic is not None:
            with _timer("cost_values", t):
                batch = self.safe.add_cost_values(batch, g.cost_critic)
        correction = self.rollouts.correction()
        if correction.reject_scope == "batch":  # verl: rejected tokens leave advantages, critic and KL too
            batch, correction_metrics = rollout_correction(batch, correction, step=self.global_step)
        with _timer("adv", t):
            batch, metrics = KL_STAGES[bool(algo.use_kl_in_reward)](self, batch)
            batch = add_advantages(batch, algo.adv_estimator, gamma=algo.gamma, lam=algo.lam,
                                   norm_adv_by_std=algo.norm_adv_by_std)
            if self.safe is not None:  # cost GAE, lambda's dual ascent, (A_r - lambda A_c) / (1 + lambda)
                batch, safe_metrics = self.safe.lagrangian_step(batch)
                metrics.update(safe_metrics)
        if g.critic is not None:
            with _timer("update_critic", t):
                metrics.update(_update_metrics(g.critic.update_critic(batch)))
        if self.safe is not None and g.cost_critic is not None:
            with _timer("update_cost_critic", t):
                metrics.update(self.safe.update_cost_critic(batch, g.cost_critic))
        if correction.reject_scope == "actor":  # megaflow: only the actor's update batch loses them
            actor_batch, correction_metrics = rollout_correction(batch, correction, step=self.global_step)
        else:
            actor_batch = batch
        metrics.update(correction_metrics)
        with _timer("update_actor", t):
            metrics.update(_update_metrics(g.actor.update_actor(actor_batch)))
        metrics.update(compute_data_metrics(batch, self.cfg.rollout.response_length))
        metrics.update(reward_metrics(batch))  # reward/<part>/mean and per data source, every step
        self.generations = _samples(self, batch, self.cfg.trainer.generations_every > 0)
        metrics.update(rollout_metrics)
        metrics.update(balance_metrics)
        metrics.update(t)
        num_tokens = int(batch.tensors["attention_mask"].sum())
        metrics["perf/total_num_tokens"] = num_tokens
        metrics["perf/throughput_tokens_per_s"] = num_tokens / max(sum(t.values()), 1e-9)
        return metrics

    def rollout(self, prompts: DataProto, n: int, *, greedy: bool) -> DataProto:
        """Repeat each prompt ``n`` times (samples of one prompt share a ``uid``) and generate
        with the current step's sampling seed (:meth:`RolloutSource.generate`).

        Returns the prompts' non-tensor fields (and tensor fields other than
        :data:`~megaflow.trainer.stages.ROLLOUT_REPLACES`) joined with the rollout's outputs
        (``prompts``, ``responses``, ``response_mask``, ``rollout_log_probs`` ``[B, R]``;
        ``input_ids``, ``attention_mask``, ``position_ids`` ``[B, S]``), ``B = n x len(prompts)``.
        """
        return self.rollouts.generate(prompts, n, greedy=greedy, step=self.global_step)[0]

    def generate_informative(self) -> tuple[DataProto, dict[str, float]]:
        """Dynamic sampling (``algorithm.filter_groups``): the step's scored batch of
        ``data.train_batch_size`` groups with reward variance, generating further rounds of
        prompts as needed (:func:`~megaflow.trainer.dynamic_sampling.fill_informative`;
        round ``i > 0``: the source's :meth:`~megaflow.trainer.rollout_source.RolloutSource.next_round`).

        Returns the batch (``token_level_scores`` and the ``reward_*`` fields included) and
        the first round's rollout metrics plus ``filter_groups/*``.
        """
        fg, target = self.cfg.algorithm.filter_groups, self.cfg.data.train_batch_size
        first: dict[str, float] = {}

        def generate_round(index: int) -> DataProto:
            if index == 0:
                batch, metrics = self.rollouts.next_batch(self.global_step)
                first.update(metrics)
            else:
                batch, _ = self.rollouts.next_round(self.global_step, index)
            return self.score(batch, keep_reward_fields=True)

        batch, metrics = fill_informative(generate_round, target, max_extra_rounds=fg.max_extra_rounds,
                                          metric=fg.metric)
        if metrics["filter_groups/cap_reached"]:
            _say(self, f"[megaflow] step {self.global_step + 1}: {int(metrics['filter_groups/informative_groups'])} "
                       f"informative groups of {target} after {int(metrics['filter_groups/rounds'])} generation "
                       f"rounds (algorithm.filter_groups.max_extra_rounds={fg.max_extra_rounds}); completed with "
                       f"{int(metrics['filter_groups/padded_groups'])} groups of equal rewards")
        return batch, {**first, **metrics}

    def add_greedy_baseline(self, batch: DataProto) -> DataProto:
        """ReMax (Li et al. 2023): the reward of each prompt's greedy response is its baseline
        (``baseline_rewards`` ``[B]``, the batch's prompts decoded greedily and scored)."""
        n = self.cfg.rollout.n
        greedy = self.score(self.rollout(prompts_of(batch, n), 1, greedy=True))
        baseline = greedy.tensors["token_level_scores"].sum(-1).repeat_interleave(n)
        return batch.union(DataProto.from_dict({"baseline_rewards": baseline}))

    def score(self, batch: DataProto, keep_reward_fields: bool = True) -> DataProto:
        """Add ``token_level_scores``: rule rewards, plus reward-model scores when configured.

        ``keep_reward_fields`` also keeps the reward function's per-sample non-tensor fields
        (``reward_score``, ``reward_acc``, ..., the reward's parts: logged every step).
        """
        scored = self.reward_fn(batch)
        extra = [k for k in scored.non_tensor_batch if k.startswith("reward_")] if keep_reward_fields else []
        if self.groups.reward_model is not None:
            rm = self.groups.reward_model.compute_rm_score(batch)
            scored.tensors["token_level_scores"] = scored.tensors["token_level_scores"] + rm.tensors["rm_scores"]
        return batch.union(scored.select(batch_keys=["token_level_scores"], non_tensor_keys=extra))

    # ------------------------------------------------------------------ the loop
    def fit(self, total_steps: int | None = None) -> dict[str, float]:
        """Train to ``total_steps`` (default ``trainer.total_steps``), validating and
        checkpointing on the cadence of ``trainer.test_freq`` / ``trainer.save_freq``.

        Returns the last step's metrics.

        Raises:
            ValueError: no ``total_steps`` while ``trainer.total_steps`` is null.
        """
        tr = self.cfg.trainer
        total = total_steps if total_steps is not None else tr.total_steps
        if total is None:
            raise ValueError("fit needs total_steps (the run's training steps) when trainer.total_steps is null")
        self.resume()
        last: dict[str, float] = {}
        eta = EtaClock(tr.test_freq if self.val_loader is not None else -1, total)
        if getattr(tr, "val_before_train", False) and self.global_step == 0 and self.val_loader is not None:
            val_metrics = self.validate()
            eta.validated(val_metrics.get("timing_s/validation"))
            self._log(val_metrics, self.global_step)
        while self.global_step < total:
            step_start = time.perf_counter()
            metrics = self.train_step()
            self.global_step += 1
            metrics["timing_s/step"] = time.perf_counter() - step_start
            eta.stepped(metrics["timing_s/step"])
            metrics.update(self.rollouts.step_done())
            bad = non_finite_metrics(metrics, self._clip_grads())
            if bad:
                self._log(metrics, self.global_step)
                raise NonFiniteMetricsError(self.global_step, bad)
            is_last = self.global_step == total
            if self.val_loader is not None and _due(tr.test_freq, self.global_step, is_last, at_end_when_zero=False):
                metrics.update(self.validate())
                eta.validated(metrics.get("timing_s/validation"))
            metrics["timing_s/eta"] = eta.remaining(self.global_step)
            self._log(metrics, self.global_step)
            if _due(tr.generations_every, self.global_step, is_last, at_end_when_zero=False):
                _log_generations(self, self.generations, "train")
            if self.checkpoints is not None and _due(tr.save_freq, self.global_step, is_last, at_end_when_zero=True):
                self.save_checkpoint()
            last = metrics
        return last

    def _clip_grads(self) -> dict[str, float]:
        """``{role: optim.clip_grad}`` of the roles that train (actor, critic when present)."""
        roles: dict[str, object] = {"actor": self.cfg.actor}
        if self.groups.critic is not None:
            roles["critic"] = self.cfg.critic
        if self.groups.cost_critic is not None:
            roles["cost_critic"] = self.cfg.critic
        return {name: float(getattr(getattr(section, "optim", None), "clip_grad", 0.0) or 0.0)
                for name, section in roles.items()}

    def validate(self) -> dict[str, float]:
        """Score the validation prompts (greedy unless ``rollout.val_do_sample``).

        Reports the mean score overall and per data source, and the mean accuracy
        (``val/acc/...``) where the reward function returns one (GSM8K, arith).
        The engines are synced to the actor's weights first (generation never syncs).
        """
        start = time.perf_counter()
        self.rollouts.sync()
        greedy = not self.cfg.rollout.val_do_sample
        scored = []
        total = len(getattr(self.val_loader, "dataset", ()))
        with _progress(getattr(self, "tracker", None), total, "validation") as bar:
            for prompts in self.val_loader:
                scored.append(self.score(self.rollout(prompts, 1, greedy=greedy), keep_reward_fields=True))
                bar.update(len(prompts))
        if not scored:
            return {}
        batch = DataProto.concat(scored)
        scores = batch.tensors["token_level_scores"].sum(-1).float()
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
        metrics["timing_s/validation"] = time.perf_counter() - start
        _log_generations(self, _samples(self, batch), "val")
        log_dir = getattr(getattr(self, "tracker", None), "log_dir", None)
        if log_dir is not None:  # multi-turn rows: a few conversations for a person to read
            write_trajectories(batch, Path(log_dir) / TRAJECTORIES_FILE, step=self.global_step, split="val",
                               count=self.cfg.trainer.generations_count)
        return metrics

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracker is not None and metrics:
            self.tracker.log(metrics, step=step)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Save every stateful part into one atomic checkpoint directory.

        Raises:
            RuntimeError: the trainer has no checkpoint manager (saving disabled).
        """
        if self.checkpoints is None:
            raise RuntimeError("save_checkpoint: this trainer was built without a CheckpointManager (saving disabled)")
        pending = self.checkpoints.begin(self.global_step)
        parts = [TRAINER_STATE_FILE, "actor"]
        self.groups.actor.save_checkpoint(str(pending.path / "actor"))
        if self.groups.critic is not None:
            self.groups.critic.save_checkpoint(str(pending.path / "critic"))
            parts.append("critic")
        if self.groups.cost_critic is not None:
            self.groups.cost_critic.save_checkpoint(str(pending.path / "cost_critic"))
            parts.append("cost_critic")
        rng, rng_tensors = capture_rng_state()
        state = {"global_step": self.global_step, "kl_ctrl": self.kl_ctrl.state_dict(),
                 "train_loader": self.rollouts.loader_state(), "rng": rng}
        if self.safe is not None:
            state["safe_rlhf"] = self.safe.state_dict()
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
        if self.groups.cost_critic is not None:
            self.groups.cost_critic.load_checkpoint(str(path / "cost_critic"))
        self.global_step = state["global_step"]
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if self.safe is not None:
            self.safe.load_state_dict(state["safe_rlhf"])
        self.rollouts.load_loader_state(state["train_loader"])
        restore_rng_state(state["rng"], tensors)
        _say(self, f"[megaflow] resumed from {path} at step {self.global_step}")


def _due(freq: int, step: int, is_last: bool, *, at_end_when_zero: bool) -> bool:
    """Cadence rule: every ``freq`` steps and after the last; 0: only after the last when
    ``at_end_when_zero`` (checkpoints) else never (validation); negative: never."""
    if freq < 0 or (freq == 0 and not at_end_when_zero):
        return False
    return is_last or (freq > 0 and step % freq == 0)


def _samples(trainer: Any, batch: DataProto, wanted: bool = True) -> list[dict[str, Any]]:
    """``trainer.generations_count`` decoded samples of ``batch``
    (:func:`~megaflow.trainer.generations.sample_generations`); none without a decoder."""
    decode = getattr(trainer, "decode", None)
    if not wanted or decode is None:
        return []
    return sample_generations(batch, decode, trainer.cfg.trainer.generations_count)


def _say(trainer: Any, message: str) -> None:
    """One console line, above the progress bar when the trainer has a tracker."""
    if getattr(trainer, "tracker", None) is not None:
        trainer.tracker.write(message)  # above the progress bar, not on its line
    else:
        print(message, flush=True)


def _log_generations(trainer: Any, records: list[dict[str, Any]], split: str) -> None:
    """Sample generations of ``split`` at the trainer's step to its tracker (if it logs them)."""
    log = getattr(getattr(trainer, "tracker", None), "log_generations", None)
    if log is not None and records:
        log(records, trainer.global_step, split)


def _progress(tracker: Any, total: int, desc: str) -> Any:
    """A bar for a long phase (validation) under the step bar: the tracker's
    :meth:`~megaflow.utils.tracking.Tracking.progress`, or a silent one without it."""
    progress = getattr(tracker, "progress", None)
    if progress is None:
        from tqdm import tqdm

        return tqdm(total=total, disable=True)
    return progress(total, desc)


class EtaClock:
    """Time left in :meth:`RayPPOTrainer.fit`, validation included.

    ``remaining(step) = (total - step) x mean step time + validations left x mean
    validation time``, with the validations left counted from ``trainer.test_freq``'s
    cadence (:func:`_due`); before the first validation its time is unknown and counts 0.

    Args:
        test_freq: ``trainer.test_freq`` (negative: no validation set).
        total: the run's last step.
    """

    def __init__(self, test_freq: int, total: int) -> None:
        self.test_freq, self.total = test_freq, total
        self.step_s: list[float] = []
        self.val_s: list[float] = []

    def stepped(self, seconds: float) -> None:
        """A training step took ``seconds`` (validation excluded)."""
        self.step_s.append(seconds)

    def validated(self, seconds: float | None) -> None:
        """A validation took ``seconds`` (None: nothing was validated)."""
        if seconds is not None:
            self.val_s.append(seconds)

    def remaining(self, step: int) -> float:
        """Seconds left after ``step`` (0 once ``step`` is the last)."""
        vals = sum(_due(self.test_freq, s, s == self.total, at_end_when_zero=False)
                   for s in range(step + 1, self.total + 1))
        mean_step = sum(self.step_s) / len(self.step_s) if self.step_s else 0.0
        mean_val = sum(self.val_s) / len(self.val_s) if self.val_s else 0.0
        return (self.total - step) * mean_step + vals * mean_val


def _kl_in_reward_stage(trainer: RayPPOTrainer, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
    return kl_in_reward(batch, trainer.kl_ctrl, trainer.cfg.algorithm.kl_penalty)


def _no_kl_stage(trainer: RayPPOTrainer, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
    return scores_as_rewards(batch)


#: ``algorithm.use_kl_in_reward`` -> the stage that turns scores into rewards.
KL_STAGES = {True: _kl_in_reward_stage, False: _no_kl_stage}

__all__ = ["RayPPOTrainer", "WorkerGroups", "KL_STAGES", "EtaClock", "capture_rng_state", "restore_rng_state",
           "NonFiniteMetricsError", "non_finite_metrics"]
