"""``make train``: load a recipe, check it, start the worker groups and run the controller.

    python -m megaflow.trainer.main --recipe tiny_arith_grpo trainer.total_steps=5
    python -m megaflow.trainer.main --recipe llama70b_ppo --dry-run

Exit codes: 0 success; 1 a layout that does not fit; 2 a config or input error (the
message names the dotted key, file or value; found before any process starts, by the
dry run too: :mod:`megaflow.trainer.preflight`; ``MEGAFLOW_DEBUG=1`` adds the traceback); 3 the cluster is missing
resources or a
worker process/node died (the message names what is missing, or the node, role and rank); 4 a
training-health check stopped the run (``algorithm.rollout_correction.max_mismatch``, a
non-finite loss or gradient norm); 130 interrupted (Ctrl-C) and 143 stopped by SIGTERM, with where it
stopped and how to resume (one line; worker groups and Ray shut down, the newest complete checkpoint
untouched). A second run on the same run directory is refused (exit 2) naming the holder of its lock.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megaflow.topology.sizes import run_dir_of
from megaflow.utils import startup_gc
from megaflow.utils.environ import exported_env
from megaflow.utils.run_lock import RunDirLock, RunDirLockedError


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megaflow.trainer.main", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", required=True, help="recipe name in recipes/ or a YAML path")
    p.add_argument("--dry-run", action="store_true",
                   help="validate and print the placement/parallel/memory plan without starting processes")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the recipe")
    return p.parse_args(argv)


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def validation_subset(dataset, max_samples: int | None, *, seed: int):
    """``dataset``, or a fixed subset of ``max_samples`` of its items (``trainer.val_max_samples``)
    drawn without replacement with ``seed`` and kept in dataset order; the same items for the
    same seed and dataset, whatever else the run changes."""
    if max_samples is None or max_samples >= len(dataset):
        return dataset
    from torch.utils.data import Subset

    picked = np.random.default_rng(seed).choice(len(dataset), size=max_samples, replace=False)
    return Subset(dataset, sorted(int(i) for i in picked))


def build_loaders(cfg, inputs):
    """(train_loader, val_loader or None, number of training prompts) over the datasets
    :func:`megaflow.trainer.preflight.preflight` loaded."""
    from megaflow.data import PromptDataLoader, collate_fn

    d = cfg.data
    train_loader = PromptDataLoader(inputs.train_dataset, d.train_batch_size, shuffle=d.shuffle, seed=d.seed,
                                    drop_last=True, collate_fn=collate_fn)
    val_loader = None
    if inputs.val_dataset is not None:
        val = validation_subset(inputs.val_dataset, cfg.trainer.val_max_samples, seed=d.seed)
        val_loader = PromptDataLoader(val, d.val_batch_size or len(val), shuffle=False, drop_last=False,
                                      collate_fn=collate_fn)
    return train_loader, val_loader, len(inputs.train_dataset)


def build_reward_fn(cfg, tokenizer, functions=None):
    """The run's rule reward of each data source: a :class:`~megaflow.rewards.RewardTable`
    of the registered scorers, the custom scorers of ``reward.functions`` (already imported
    by the pre-start checks when ``functions`` is given) and, with ``reward.format_weight``
    > 0, the format reward around each. The process registry is not changed."""
    from megaflow.rewards import RewardTable, RuleRewardManager
    from megaflow.rewards.format import THINK_ANSWER_PATTERN
    from megaflow.trainer.preflight import resolve_reward_functions

    rc = cfg.reward
    table = RewardTable.registered().with_functions(
        functions if functions is not None else resolve_reward_functions(cfg))
    if rc.format_weight > 0:
        table = table.with_format_reward(rc.format_pattern or THINK_ANSWER_PATTERN, rc.format_weight)
    return RuleRewardManager(tokenizer, reward_kwargs=rc.reward_kwargs, table=table)


#: Whether this process's init_ray started (or connected) the Ray it uses; a Ray that the
#: caller initialised (an embedding program, the test suite) is left running at the end.
_started_ray = False


def worker_env() -> dict[str, str]:
    """Environment variables of every worker process Ray starts for the run (name -> value):
    one OpenMP thread until the rank sets its own, vLLM's log level (``ERROR`` unless this
    process's ``VLLM_LOGGING_LEVEL`` says otherwise) and the warning filters of
    :func:`megaflow.utils.tracking.warning_filters_env`."""
    from megaflow.utils.tracking import warning_filters_env

    # Ray's own worker processes stay single-threaded; each rank's process sets its threads
    # from resources.num_cpus_per_proc (megaflow.single_controller.host.WorkerHost).
    return {"OMP_NUM_THREADS": "1",
            # vLLM logs every engine start at INFO; keep the console to the run's own output.
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
            # megatron-core's start-up warnings would repeat once per worker: known ones are
            # filtered (megaflow.utils.tracking.KNOWN_LIBRARY_WARNINGS says why each is safe).
            "PYTHONWARNINGS": warning_filters_env(os.environ.get("PYTHONWARNINGS", "ignore::FutureWarning"))}


def init_ray(cfg) -> None:
    """Connect to ``ray.address`` or start a local Ray bound to localhost (a no-op when
    Ray is already initialised in this process).

    The workers' environment (:func:`worker_env`) is the job's ``runtime_env`` on a cluster.
    A local Ray gets it by inheritance instead: it is in this process's environment while
    ``ray.init`` starts the raylet, whose worker processes inherit it. The job then has no
    ``runtime_env``, so the workers that Ray prestarts while it starts (one per CPU) match the
    job's actors and become them, instead of idling beside a freshly started process per rank
    (a worker started for a runtime environment boots the interpreter and Ray's core worker
    again: 0.6-1.1 s more to a rank's first reply, measured on the 2-core CPU). The raylet also
    gets :func:`megaflow.launch.node.node_env`: its workers run at nice 0, not Ray's default 15.
    This process's own environment is the same afterwards.
    """
    import ray

    global _started_ray
    if ray.is_initialized():
        return
    _started_ray = True
    r = cfg.ray
    kwargs = dict(namespace=r.namespace, include_dashboard=r.include_dashboard)
    if r.address:
        from megaflow.launch.auth import enable_token_auth
        from megaflow.launch.cluster import wait_for_cluster
        from megaflow.launch.resources import launch_requirements

        enable_token_auth()
        ray.init(address=r.address, runtime_env={"env_vars": worker_env()}, **kwargs)
        # A bounded wait: fewer resources than the recipe needs -> an error saying what is
        # needed and what joined, instead of placement groups pending forever.
        wait_for_cluster(launch_requirements(cfg), r.resource_wait_timeout_s, address=r.address)
    else:
        # address="local": never join a cluster that happens to run on this machine; every
        # listener of the local Ray on 127.0.0.1 only (megaflow.launch.local)
        from megaflow.launch.local import loopback_ray_options
        from megaflow.launch.node import node_env

        with exported_env({**worker_env(), **node_env()}):
            try:
                ray.init(address="local", num_cpus=r.num_cpus, dashboard_host=r.dashboard_host, **kwargs,
                         **loopback_ray_options())
            except Exception as err:  # Ray raises a bare Exception when its node does not start
                ray.shutdown()  # the GCS and raylet it did start
                raise local_ray_failed(err) from err
    from megaflow.launch.failures import stop_cleanly_on_sigterm

    stop_cleanly_on_sigterm(reset=False)  # ray.init replaced it with sys.exit(15)


def local_ray_failed(err: BaseException):
    """The one-line error for a local ``ray.init`` that raised (typically "The current node
    timed out during startup" on an overloaded machine): a
    :class:`~megaflow.launch.cluster.ClusterNotReadyError`, so the run exits 3 without a traceback."""
    from megaflow.launch.cluster import ClusterNotReadyError

    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return ClusterNotReadyError(
        f"the local Ray did not start: {first} (a busy or memory-short machine is the usual cause; "
        "Ray's own logs are under /tmp/ray/session_latest/logs); nothing was trained, start the run again")


def _stop_local_ray(cfg) -> None:
    """Stop the Ray that :func:`init_ray` started (its helper processes end with it); a
    cluster given by ``ray.address`` is only disconnected from, and a Ray the caller had
    initialised before is left alone."""
    import ray

    global _started_ray
    if _started_ray and ray.is_initialized():
        ray.shutdown()
    _started_ray = False


def _fit_naming_lost_workers(trainer, groups, total_steps: int) -> dict[str, float]:
    """``trainer.fit`` where a dead worker process or node becomes a
    :class:`~megaflow.launch.failures.WorkerLostError` naming node, role and rank."""
    from megaflow.launch.failures import (
        RunInterrupted,
        Terminated,
        find_dead_ranks,
        is_worker_death,
        placements_of,
        sigterm_received,
        worker_lost_error,
    )

    try:
        return trainer.fit(total_steps)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (Terminated)
        latest = trainer.checkpoints.latest() if trainer.checkpoints is not None else None
        by_sigterm = isinstance(stop, Terminated) or sigterm_received()
        raise RunInterrupted(trainer.global_step, latest, by_sigterm=by_sigterm) from None
    except Exception as err:
        placements = placements_of(groups.named())
        dead = find_dead_ranks(err, placements)  # whoever raised, blame the rank that is actually dead
        if not dead and not is_worker_death(err):
            raise
        raise worker_lost_error(err, placements, dead=dead) from err


class _StartupClock:
    """Wall-clock seconds of the start-up phases, the first counted from the process's creation
    (interpreter, imports, config and preflight checks)."""

    def __init__(self) -> None:
        import time

        import psutil

        self._now = time.time
        self._last = psutil.Process().create_time()
        self.laps = [("before Ray (interpreter, imports, config, checks)", self._now() - self._last)]
        self._last = self._now()

    def lap(self, name: str) -> None:
        """Close the phase ``name`` at the current time."""
        now = self._now()
        self.laps.append((name, now - self._last))
        self._last = now

    def __str__(self) -> str:
        total = sum(s for _, s in self.laps)
        return f"{total:.1f} s to the workers' readiness: " + ", ".join(f"{n} {s:.1f} s" for n, s in self.laps)


def train(cfg, inputs=None, *, watchdog=None) -> dict[str, float]:
    """Run training for a loaded, validated config; returns the last step's metrics.

    Args:
        inputs: what :func:`megaflow.trainer.preflight.preflight` returned for ``cfg``
            (None: it runs here first). Nothing is created before those checks passed but
            the run directory's lock (:mod:`megaflow.utils.run_lock`), under which the
            checks of :func:`prepare_run` run again; a directory created for the lock is
            removed again when they refuse.
        watchdog: the controller's :class:`~megaflow.launch.watchdog.Watchdog`, told the
            local Ray's processes (None: Ray's helpers are left to Ray).

    Raises:
        ConfigError: a pre-start check failed (a :class:`PreflightError` listing them).
        RunDirLockedError: another run holds the run directory.
        RunInterrupted: Ctrl-C or SIGTERM during training.
    """
    startup_gc.pause()  # until the workers are ready (megaflow.utils.startup_gc says why)
    try:
        return _train(cfg, inputs, watchdog)
    finally:
        startup_gc.resume(freeze=False)  # a no-op once _train resumed it after start-up


@dataclass
class Prepared:
    """What the checks before the first step built, for the run to use: the prompt loaders,
    the number of steps, the checkpoint to resume from (or None), the reward function and
    Safe RLHF's cost and multiplier (None unless algorithm.safe_rlhf.enable)."""

    train_loader: Any
    val_loader: Any
    total_steps: int
    resume_point: Any
    reward_fn: Any
    safe_rlhf: Any = None


def prepare_run(cfg, inputs) -> Prepared:
    """The checks that need the loaded data, run by the dry run and by the run (under the run
    directory's lock) alike: the run's length, ``trainer.resume`` (verified, same layout and
    config, not already finished), the LR schedules' horizons and the reward functions.

    Raises:
        ConfigError: naming the key (exit code 2).
    """
    from megaflow.topology import lr_schedule_steps, num_training_steps
    from megaflow.trainer.resume import check_not_finished, check_resume

    train_loader, val_loader, num_prompts = build_loaders(cfg, inputs)
    total_steps = num_training_steps(cfg, num_prompts)
    resume_point = check_resume(cfg)
    check_not_finished(resume_point, total_steps)  # a finished run says so before anything starts
    for role in ("actor", "critic"):  # the LR decay horizon needs the run length: check it before Ray starts
        if role == "actor" or cfg.critic.enabled:
            lr_schedule_steps(cfg, role, total_steps)
    reward_fn = build_reward_fn(cfg, inputs.tokenizer, inputs.reward_functions)
    safe = None
    if cfg.algorithm.safe_rlhf.enable:  # the cost function is imported before Ray starts
        from megaflow.trainer.safe_rlhf import SafeRLHF

        safe = SafeRLHF(cfg, inputs.tokenizer)
    return Prepared(train_loader, val_loader, total_steps, resume_point, reward_fn, safe)


def _say_where_it_starts(cfg, prepared: Prepared) -> None:
    """Print which checkpoint the run resumes from and which newer saves it passes over."""
    from megaflow.trainer.resume import describe_resume

    line = describe_resume(cfg, prepared.resume_point)
    if line is not None:
        print(line, flush=True)


def _lock_run_dir(cfg, inputs) -> tuple[RunDirLock, Prepared]:
    """Take the run directory's lock (:mod:`megaflow.utils.run_lock`), then run
    :func:`prepare_run` under it, so that no other run changes the checkpoints between the
    resume checks and this run's use of them. On a refusal the lock is released, the
    generated task files are removed and so are the directories created for the lock.

    Raises:
        RunDirLockedError: another live run holds the directory.
        ConfigError: a check of :func:`prepare_run` failed.
    """
    run_dir = run_dir_of(cfg)
    created = next((p for p in (run_dir, *run_dir.parents) if p.parent.exists()), None)
    created = created if created is not None and not created.exists() else None
    lock = RunDirLock(run_dir)
    try:
        lock.acquire()
        return lock, prepare_run(cfg, inputs)
    except BaseException:
        inputs.discard_generated()
        held = lock.held
        lock.release()
        if held and created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise


def _train(cfg, inputs, watchdog) -> dict[str, float]:
    from megaflow.trainer.preflight import preflight

    if inputs is None:
        inputs = preflight(cfg)
    lock, prepared = _lock_run_dir(cfg, inputs)
    try:
        return _train_locked(cfg, inputs, prepared, watchdog)
    finally:
        lock.release()


def _train_locked(cfg, inputs, prepared: Prepared, watchdog) -> dict[str, float]:
    from megaflow.config import config_to_dict, dump_config
    from megaflow.trainer.checkpoint import CheckpointManager
    from megaflow.trainer.ppo_trainer import RayPPOTrainer
    from megaflow.trainer.roles import build_worker_groups, shutdown_worker_groups
    from megaflow.utils.tracking import Tracking, filter_known_warnings

    tokenizer, total_steps, resume_point = inputs.tokenizer, prepared.total_steps, prepared.resume_point
    run_dir = run_dir_of(cfg)
    _say_where_it_starts(cfg, prepared)
    inputs.keep_generated(run_dir / "data")
    seed_everything(cfg.trainer.seed)
    filter_known_warnings()
    checkpoints = CheckpointManager(run_dir / "checkpoints", keep_last=cfg.trainer.max_ckpt_to_keep)
    for stale in checkpoints.remove_partials():  # safe: this process holds the run directory's lock
        print(f"[megaflow] removed {stale} (left by an interrupted save)", flush=True)
    startup = _StartupClock()
    init_ray(cfg)
    if watchdog is not None and _started_ray:
        from megaflow.launch.watchdog import local_ray_pids

        watchdog.track(local_ray_pids())
    startup.lap("Ray")
    groups = build_worker_groups(cfg, tokenizer, total_steps)
    startup_gc.resume(freeze=False)
    startup.lap("worker processes and models")
    print(f"[megaflow] start-up: {startup}", flush=True)
    try:
        with Tracking(cfg.trainer.project_name, cfg.trainer.experiment_name, cfg.trainer.logger, log_dir=run_dir,
                      config=config_to_dict(cfg), total_steps=total_steps,
                      # the bar counts this run's steps
                      initial_step=resume_point.step if resume_point is not None else 0,
                      console_every=cfg.trainer.console_every) as tracker:
            trainer = RayPPOTrainer(cfg, groups, prepared.reward_fn, prepared.train_loader, prepared.val_loader,
                                    tracker, checkpoints, config_yaml=dump_config(cfg),
                                    decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
                                    safe_rlhf=prepared.safe_rlhf)
            metrics = _fit_naming_lost_workers(trainer, groups, total_steps)
            if cfg.trainer.export_hf:
                groups.actor.export_hf(str(run_dir / "hf"))
    finally:
        shutdown_worker_groups(groups)
    print(f"[megaflow] run directory: {run_dir}", flush=True)
    return metrics


def _report_config_error(exc: Exception) -> int:
    """Print an expected input error, one line per problem, and return exit code 2
    (``MEGAFLOW_DEBUG=1`` re-raises it for the traceback)."""
    from megaflow.trainer.preflight import PreflightError
    from megaflow.utils.cli import EXIT_INPUT_ERROR, debug_enabled

    if debug_enabled():
        raise exc
    problems = exc.problems if isinstance(exc, PreflightError) else [exc]
    for problem in problems:
        print(f"megaflow: config error: {problem}", file=sys.stderr)
    return EXIT_INPUT_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    """``make train``: exit code 0, 1, 2, 3, 4, 130 or 143 (see the module docstring)."""
    args = parse_args(argv)
    from megaflow.launch.failures import stop_cleanly_on_sigterm
    from megaflow.launch.watchdog import Watchdog

    previous = stop_cleanly_on_sigterm()
    watchdog = Watchdog.start()  # Ray's helpers and the temporary files go with this process, however it ends
    try:
        return _main(args, watchdog)
    finally:
        watchdog.close()
        if previous is not None:  # main() called in a program (a test) leaves its handler as it was
            signal.signal(signal.SIGTERM, previous)


def _main(args: argparse.Namespace, watchdog) -> int:
    from megaflow.config import ConfigError
    from megaflow.dryrun import build_plan, format_plan
    from megaflow.launch.failures import exit_code_of
    from megaflow.topology import load_run
    from megaflow.trainer.preflight import preflight

    try:
        cfg = load_run(args.recipe, args.overrides)
        plan = build_plan(cfg)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        return _report_config_error(exc)
    if args.dry_run:
        print(format_plan(plan))
    elif not plan.fits:
        print(format_plan(plan), file=sys.stderr)
        print("megaflow: this layout does not fit the configured resources (see the plan above)", file=sys.stderr)
        return 1
    # Files, data, the tokenizer, this machine, the run's length and trainer.resume, before
    # any process starts; a dry run runs the same checks (after its plan), with the same
    # lines and exit code.
    inputs = None
    try:
        inputs = preflight(cfg)
        prepared = prepare_run(cfg, inputs)
        if args.dry_run:
            _say_where_it_starts(cfg, prepared)
            return 0 if plan.fits else 1
        return _run(cfg, inputs, watchdog)
    except ConfigError as exc:
        return _report_config_error(exc)
    except KeyboardInterrupt as exc:
        print(f"megaflow: {'stopped by SIGTERM' if exit_code_of(exc) == 143 else 'interrupted'} before training "
              "started; nothing was saved", file=sys.stderr)
        return exit_code_of(exc)
    finally:
        if inputs is not None:
            inputs.discard_generated()  # a no-op once the run moved them into its directory
        _stop_local_ray(cfg)


def _run(cfg, inputs, watchdog) -> int:
    """:func:`train`, its expected failures turned into a line and an exit code."""
    from megaflow.config import ConfigError
    from megaflow.launch.cluster import ClusterNotReadyError
    from megaflow.launch.failures import RunInterrupted, WorkerLostError, exit_code_of
    from megaflow.trainer.ppo_trainer import NonFiniteMetricsError
    from megaflow.trainer.stages import RolloutMismatchError

    try:
        train(cfg, inputs, watchdog=watchdog)
    except ConfigError as exc:
        return _report_config_error(exc)
    except RunDirLockedError as exc:
        print(f"megaflow: {exc}", file=sys.stderr)
        return 2
    except (WorkerLostError, ClusterNotReadyError) as exc:
        print(f"megaflow: {exc}", file=sys.stderr)
        return 3
    except (RolloutMismatchError, NonFiniteMetricsError) as exc:
        print(f"megaflow: stopped: {exc}", file=sys.stderr)
        return 4
    except RunInterrupted as exc:
        print(f"megaflow: {exc}", file=sys.stderr)
        return exit_code_of(exc)
    return 0


if __name__ == "__main__":
    startup_gc.pause()  # the imports and checks ahead; train() resumes it once the workers are ready
    sys.exit(main())
