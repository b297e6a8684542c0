"""``make train``: load a recipe, check it, start the worker groups and run the controller.

    python -m megaflow.trainer.main --recipe tiny_arith_grpo trainer.total_steps=5
    python -m megaflow.trainer.main --recipe llama70b_ppo --dry-run

Exit codes: 0 success; 1 a layout that does not fit; 2 a config or input error (the
message names the dotted key, file or value); 3 the cluster is missing resources or a
worker process/node died (the message names what is missing, or the node, role and rank); 4 a
training-health check stopped the run (``algorithm.rollout_correction.max_mismatch``).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path
from typing import Sequence

import numpy as np


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megaflow.trainer.main", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", required=True, help="recipe name in recipes/ or a YAML path")
    p.add_argument("--dry-run", action="store_true",
                   help="validate and print the placement/parallel/memory plan without starting processes")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the recipe")
    return p.parse_args(argv)


def run_dir_of(cfg) -> Path:
    """``<output_dir>/<project_name>/<experiment_name>``."""
    tr = cfg.trainer
    return Path(tr.output_dir) / tr.project_name / tr.experiment_name


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def data_files(cfg, run_dir: Path) -> tuple[list[str], list[str]]:
    """Training and validation files: the recipe's, or generated for a built-in task."""
    d = cfg.data
    if d.task == "arith":
        from megaflow.data import ArithTaskConfig, write_arith_dataset

        files = write_arith_dataset(run_dir / "data", ArithTaskConfig(**dict(d.task_args)))
        return [str(files["train"])], [str(files["val"])]
    return list(d.train_files), list(d.val_files)


def build_loaders(cfg, tokenizer, run_dir: Path):
    """(train_loader, val_loader or None, number of training prompts)."""
    from megaflow.data import PromptDataLoader, RLHFDataset, collate_fn

    d = cfg.data
    train_files, val_files = data_files(cfg, run_dir)

    def dataset(files):
        return RLHFDataset(files, tokenizer, max_prompt_length=d.max_prompt_length, prompt_key=d.prompt_key,
                           overlong_prompts="filter" if d.filter_overlong_prompts else "error",
                           use_chat_template=d.apply_chat_template)

    train = dataset(train_files)
    train_loader = PromptDataLoader(train, d.train_batch_size, shuffle=d.shuffle, seed=d.seed, drop_last=True,
                                    collate_fn=collate_fn)
    val_loader = None
    if val_files and cfg.trainer.test_freq != 0 or (val_files and cfg.trainer.val_before_train):
        val = dataset(val_files)
        val_loader = PromptDataLoader(val, d.val_batch_size or len(val), shuffle=False, drop_last=False,
                                      collate_fn=collate_fn)
    return train_loader, val_loader, len(train)


def build_reward_fn(cfg, tokenizer):
    """The rule reward of each data source (custom scorers from ``reward.functions``)."""
    import importlib

    from megaflow.rewards import RuleRewardManager, get_reward_spec, known_data_sources, register_reward
    from megaflow.rewards.format import THINK_ANSWER_PATTERN, with_format_reward

    rc = cfg.reward
    for source, target in rc.functions.items():
        module, _, name = target.partition(":")
        fn = getattr(importlib.import_module(module), name)
        register_reward(source, override=True)(fn)
    if rc.format_weight > 0:
        pattern = rc.format_pattern or THINK_ANSWER_PATTERN
        for source in known_data_sources():
            spec = get_reward_spec(source)
            register_reward(source, override=True, skip_special_tokens=spec.skip_special_tokens)(
                with_format_reward(spec.fn, pattern, format_weight=rc.format_weight))
    return RuleRewardManager(tokenizer, reward_kwargs=rc.reward_kwargs)


def init_ray(cfg) -> None:
    """Connect to ``ray.address`` or start a local Ray bound to localhost."""
    import ray

    if ray.is_initialized():
        return
    r = cfg.ray
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           # vLLM logs every engine start at INFO; keep the console to the run's own output.
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
           "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore::FutureWarning")}
    kwargs = dict(namespace=r.namespace, include_dashboard=r.include_dashboard, runtime_env={"env_vars": env})
    if r.address:
        from megaflow.launch.auth import enable_token_auth
        from megaflow.launch.cluster import wait_for_cluster
        from megaflow.launch.resources import cluster_requirement

        enable_token_auth()
        ray.init(address=r.address, **kwargs)
        # A bounded wait: fewer resources than the recipe needs -> an error saying what is
        # needed and what joined, instead of placement groups pending forever.
        wait_for_cluster(cluster_requirement(cfg), r.resource_wait_timeout_s, address=r.address)
    else:
        # address="local": never join a cluster that happens to run on this machine
        ray.init(address="local", num_cpus=r.num_cpus, dashboard_host=r.dashboard_host, **kwargs)


def _fit_naming_lost_workers(trainer, groups, total_steps: int) -> dict[str, float]:
    """``trainer.fit`` where a dead worker process or node becomes a
    :class:`~megaflow.launch.failures.WorkerLostError` naming node, role and rank."""
    from megaflow.launch.failures import is_worker_death, placements_of, worker_lost_error

    try:
        return trainer.fit(total_steps)
    except Exception as err:  # noqa: BLE001 - re-raised unchanged unless a worker died
        if not is_worker_death(err):
            raise
        roles = {name: g for name, g in (("actor", groups.actor), ("ref", groups.ref), ("critic", groups.critic),
                                         ("reward_model", groups.reward_model)) if g is not None}
        raise worker_lost_error(err, placements_of(roles)) from err


def train(cfg) -> dict[str, float]:
    """Run training for a loaded, validated config; returns the last step's metrics."""
    from megaflow.config import config_to_dict, dump_config, lr_schedule_steps, num_training_steps
    from megaflow.data import get_tokenizer
    from megaflow.trainer.checkpoint import CheckpointManager
    from megaflow.trainer.ppo_trainer import RayPPOTrainer
    from megaflow.trainer.roles import build_worker_groups, shutdown_worker_groups
    from megaflow.utils.tracking import Tracking

    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.trainer.seed)
    tokenizer = get_tokenizer(os.path.expanduser(cfg.model.tokenizer or cfg.model.path))
    try:
        train_loader, val_loader, num_prompts = build_loaders(cfg, tokenizer, run_dir)
    except (OSError, ValueError) as exc:  # missing/malformed files, over-long prompts: before any process starts
        from megaflow.config import ConfigError

        raise ConfigError("data.train_files / data.val_files", str(exc)) from exc
    total_steps = num_training_steps(cfg, num_prompts)
    for role in ("actor", "critic"):  # the LR decay horizon needs the run length: check it before Ray starts
        if role == "actor" or cfg.critic.enabled:
            lr_schedule_steps(cfg, role, total_steps)
    reward_fn = build_reward_fn(cfg, tokenizer)
    init_ray(cfg)
    groups = build_worker_groups(cfg, tokenizer, total_steps)
    checkpoints = CheckpointManager(run_dir / "checkpoints", keep_last=cfg.trainer.max_ckpt_to_keep)
    try:
        with Tracking(cfg.trainer.project_name, cfg.trainer.experiment_name, cfg.trainer.logger, log_dir=run_dir,
                      config=config_to_dict(cfg), total_steps=total_steps) as tracker:
            trainer = RayPPOTrainer(cfg, groups, reward_fn, train_loader, val_loader, tracker, checkpoints,
                                    config_yaml=dump_config(cfg))
            metrics = _fit_naming_lost_workers(trainer, groups, total_steps)
            if cfg.trainer.export_hf:
                groups.actor.export_hf(str(run_dir / "hf"))
    finally:
        shutdown_worker_groups(groups)
    print(f"[megaflow] run directory: {run_dir}", flush=True)
    return metrics


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from megaflow.config import ConfigError, build_plan, format_plan, load_config

    try:
        cfg = load_config(args.recipe, args.overrides)
        plan = build_plan(cfg)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"megaflow: config error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(format_plan(plan))
        return 0 if plan.fits else 1
    if not plan.fits:
        print(format_plan(plan), file=sys.stderr)
        print("megaflow: this layout does not fit the configured resources (see the plan above)", file=sys.stderr)
        return 1
    from megaflow.launch.cluster import ClusterNotReadyError
    from megaflow.launch.failures import WorkerLostError
    from megaflow.trainer.stages import RolloutMismatchError

    try:
        train(cfg)
    except ConfigError as exc:
        print(f"megaflow: config error: {exc}", file=sys.stderr)
        return 2
    except (WorkerLostError, ClusterNotReadyError) as exc:
        print(f"megaflow: {exc}", file=sys.stderr)
        return 3
    except RolloutMismatchError as exc:
        print(f"megaflow: stopped: {exc}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
