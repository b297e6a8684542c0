"""What the controller checks about ``trainer.resume`` before any process starts.

:func:`check_resume` runs right after the config is loaded (``DRY_RUN=1`` reports the same
errors): it maps ``trainer.resume`` to a checkpoint, verifies it (checksums against its
manifest, every pickle read without running code), compares the parallel layout it was
saved with and its ``config.yaml`` with the run's. :func:`check_not_finished` runs once
the number of steps is known (it depends on the dataset). Every refusal is a
:class:`~megaflow.config.ConfigError` naming the key, the file or the differing sizes
(exit code 2, no traceback).

Which config keys may differ on resume (:data:`RESUME_MAY_DIFFER`): those that change
neither what a step computes nor the data it sees: the run's length and cadence
(``trainer.total_steps``, ``save_freq``, ...), where output goes and how it is logged,
validation, memory placement (offload, recomputation, KV-cache size), the machines
(``resources.*``: a DP change reshards the optimizer state) and the Ray cluster. Every other difference (learning rate,
algorithm, model, data, batch and
micro-batch sizes, seeds, sampling, ...) would make the resumed run something else than
the continuation of the saved one, and is refused unless
``trainer.resume_ignore_config_diff=true``. The optimizer state reshards across DP sizes
but is tied to the model-parallel layout, so a TP/PP/CP/VPP change is refused naming the
sizes whatever that key.
"""
from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megaflow.config import ConfigError
from megaflow.trainer.checkpoint import CheckpointManager, IntegrityError, read_trainer_state

#: Dotted keys (fnmatch patterns) that may differ between a checkpoint's config and the
#: resumed run's.
RESUME_MAY_DIFFER: tuple[str, ...] = (
    "trainer.total_steps", "trainer.total_epochs", "trainer.save_freq", "trainer.test_freq",
    "trainer.val_before_train", "trainer.output_dir", "trainer.resume", "trainer.resume_ignore_config_diff",
    "trainer.max_ckpt_to_keep", "trainer.export_hf", "trainer.logger", "trainer.project_name",
    "trainer.experiment_name", "trainer.console_*",
    "data.val_files", "data.val_batch_size", "rollout.val_*",
    "*.param_offload", "*.grad_offload", "*.optimizer_offload", "*.recompute_*",
    "rollout.gpu_memory_utilization", "rollout.cpu_kv_cache_gib", "rollout.sleep_level", "rollout.enforce_eager",
    "resources.*", "ray.*",
)
#: Worker-group parts of a trainer checkpoint that record a parallel layout.
_TRAINED_ROLES = ("actor", "critic")
_MISSING = object()


@dataclass(frozen=True)
class ResumePoint:
    """A verified checkpoint to resume from."""

    path: Path
    step: int


def run_checkpoints(cfg) -> CheckpointManager:
    """The checkpoint manager of the run directory ``<output_dir>/<project>/<experiment>/checkpoints``."""
    from megaflow.topology.sizes import run_dir_of

    return CheckpointManager(run_dir_of(cfg) / "checkpoints", keep_last=cfg.trainer.max_ckpt_to_keep)


def _flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict) and tree:
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), tree


def _normal(value: Any) -> Any:
    """Tuples and lists compare equal (YAML has only lists)."""
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    return value


def config_differences(saved: dict, now: dict, may_differ: tuple[str, ...] = RESUME_MAY_DIFFER
                       ) -> list[tuple[str, Any, Any]]:
    """``(dotted key, saved value, current value)`` of every key that differs and is not
    allowed to, sorted by key; a key present on one side only has ``"<absent>"`` on the other."""
    a, b = dict(_flatten(saved)), dict(_flatten(now))
    out = []
    for key in sorted(set(a) | set(b)):
        if any(fnmatch.fnmatchcase(key, pattern) for pattern in may_differ):
            continue
        va, vb = _normal(a.get(key, _MISSING)), _normal(b.get(key, _MISSING))
        if va != vb:
            out.append((key, "<absent>" if va is _MISSING else va, "<absent>" if vb is _MISSING else vb))
    return out


def layout_differences(checkpoint: Path, cfg) -> list[str]:
    """Per trained role, the model-parallel sizes (tp, pp, cp, vpp, ep) that differ between the
    checkpoint's ``<role>/layout.json`` and the run's plan, as ``"actor: tp 2 -> 1 (dp 1 -> 2)"``
    (a DP change alone reshards and is not listed)."""
    from megaflow.topology import enabled_roles, role_parallel

    out = []
    for role in _TRAINED_ROLES:
        path = checkpoint / role / "layout.json"
        if role not in enabled_roles(cfg) or not path.is_file():  # a disabled role has no mesh (nor pool)
            continue
        saved = json.loads(path.read_text())
        now = role_parallel(cfg, role)
        current = {"tp": now.tp, "pp": now.pp, "cp": now.cp, "vpp": now.vpp, "ep": now.ep}
        saved.setdefault("ep", 1)  # written before expert parallelism: ep = 1
        changed = [f"{k} {saved.get(k)} -> {v}" for k, v in current.items() if saved.get(k) != v]
        if changed:
            dp = f" (dp {saved.get('dp')} -> {now.dp})" if saved.get("dp") != now.dp else ""
            out.append(f"{role}: {', '.join(changed)}{dp}")
    return out


def _format_value(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def check_resume(cfg, manager: CheckpointManager | None = None) -> ResumePoint | None:
    """Resolve and check ``trainer.resume`` before Ray starts (see module docstring).

    Args:
        manager: the run's checkpoint manager (default :func:`run_checkpoints`); pass the
            one the trainer uses so that it does not verify the checkpoint again.

    Returns:
        The checkpoint to resume from, or None (``disable``, or ``auto`` without one).

    Raises:
        ConfigError: ``trainer.resume`` names nothing usable, the checkpoint fails
            verification (the file is named), its layout or its config differs.
    """
    manager = manager or run_checkpoints(cfg)
    key = "trainer.resume"
    try:
        path = manager.resolve(cfg.trainer.resume)
    except FileNotFoundError as err:
        raise ConfigError(key, str(err).removeprefix(f"{key}=")) from None
    if path is None:
        return None
    try:
        manager.verify(path)
        state, _ = read_trainer_state(path)
    except IntegrityError as err:
        raise ConfigError(key, f"checkpoint {path} cannot be trusted: {err}") from None
    layout = layout_differences(path, cfg)
    if layout:
        raise ConfigError(key, f"checkpoint {path} was saved with another model-parallel layout ({'; '.join(layout)}); "
                               "its optimizer state only loads at the tp/pp/cp/vpp/ep sizes it was saved with (at "
                               "any dp). Resume with the saved sizes, or start a new run (another "
                               "trainer.experiment_name) from its model (model.path="
                               + str(path / "actor" / "model") + "; a LoRA checkpoint holds adapters only)")
    saved_yaml = path / "config.yaml"
    if saved_yaml.is_file() and not getattr(cfg.trainer, "resume_ignore_config_diff", False):
        from megaflow.config import config_to_dict

        saved = yaml.safe_load(saved_yaml.read_text()) or {}
        diff = config_differences(saved, config_to_dict(cfg))
        if diff:
            listed = "; ".join(f"{k}: {_format_value(a)} in the checkpoint, {_format_value(b)} now"
                               for k, a, b in diff)
            raise ConfigError(key, f"the run's config differs from {saved_yaml} in keys that change the run "
                                   f"({listed}); resume with the checkpoint's values, use another "
                                   "trainer.experiment_name for a new run, or set "
                                   "trainer.resume_ignore_config_diff=true to go on anyway")
    return ResumePoint(path=path, step=int(state["global_step"]))


def describe_resume(cfg, point: ResumePoint | None, manager: CheckpointManager | None = None) -> str | None:
    """The line saying where the run starts: the checkpoint taken (and why: ``trainer.resume``
    named it, or it is the newest complete one) and each newer save passed over with the
    reason; None for a fresh run with nothing to pass over."""
    manager = manager or run_checkpoints(cfg)
    mode = cfg.trainer.resume
    skipped = manager.skipped_newer(point.step if point is not None else -1) if mode == "auto" else []
    passed = "; skipped newer: " + ", ".join(f"{p.name} ({why})" for p, why in skipped) if skipped else ""
    if point is not None:
        why = "the newest complete checkpoint (trainer.resume=auto)" if mode == "auto" else "named by trainer.resume"
        return f"[megaflow] resuming from {point.path} at step {point.step}: {why}{passed}"
    if skipped:
        return f"[megaflow] starting at step 0: no complete checkpoint in {manager.root}{passed}"
    return None


def check_not_finished(point: ResumePoint | None, total_steps: int) -> None:
    """Refuse to resume a run that already reached its last step.

    Raises:
        ConfigError: (``trainer.total_steps``) the checkpoint's step is >= ``total_steps``.
    """
    if point is not None and point.step >= total_steps:
        raise ConfigError("trainer.total_steps",
                          f"this run already finished: checkpoint {point.path} is at step {point.step} and the "
                          f"run has {total_steps} steps, so there is nothing to train. Raise trainer.total_steps "
                          "to train further, or use another trainer.experiment_name (or trainer.resume=disable "
                          "with a new output directory) for a new run")


__all__ = ["RESUME_MAY_DIFFER", "ResumePoint", "run_checkpoints", "config_differences", "layout_differences",
           "check_resume", "check_not_finished", "describe_resume"]
