"""Atomic checkpoint directories for the controller and its worker groups.

Layout under ``root`` (the run's ``checkpoints/`` directory)::

    global_step_20/            complete checkpoint (renamed into place as the last step)
        COMPLETE               JSON: step, time, parts written; present only when complete
        MANIFEST.json          size and sha256 of every file (megaflow.utils.integrity)
        trainer_state.json     controller state: step, dataloader position, KL controller,
                               Python and numpy RNG (plain JSON)
        rng_state.pt           torch RNG state (a tensor; read with weights_only=True)
        config.yaml            the run's resolved config
        actor/ critic/ ...     worker-group parts (megatron-core distributed checkpoints)
    .global_step_30.incomplete-<id>/   a save in progress, or one that crashed: never
                               loaded, removed by :meth:`CheckpointManager.remove_partials`
    latest                     text file with the name of the newest complete checkpoint

A save is one :mod:`megaflow.utils.atomic_dir` directory: everything is written into its
hidden ``.incomplete-`` sibling, which :meth:`CheckpointManager.commit` seals (manifest,
then ``COMPLETE``), fsyncs and renames to its final name (atomic on POSIX within one
filesystem); then ``latest`` is replaced atomically. A crash at any point leaves the
previous checkpoint intact and the new one unmistakably incomplete (no ``COMPLETE``, a
hidden ``.incomplete-`` name). No file holds a pickled Python object: loading runs no
code from the checkpoint (:meth:`CheckpointManager.verify` checks checksums and every
pickle the distributed-checkpoint libraries keep).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megaflow.utils.atomic_dir import (
    COMPLETE_MARKER,
    commit_directory,
    final_name_of,
    fsync_path,
    remove_temporary_siblings,
    temporary_sibling,
)
from megaflow.utils.integrity import IntegrityError, check_dcp_pickles, load_tensors, read_json, verify_manifest

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
TRAINER_STATE_FILE, RNG_STATE_FILE = "trainer_state.json", "rng_state.pt"
#: The format of ``trainer_state.json``; older checkpoints (a pickled ``trainer_state.pt``)
#: are refused.
TRAINER_STATE_VERSION = 1


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new content, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint being written: parts go under ``path``; :meth:`CheckpointManager.commit` publishes it."""

    step: int
    path: Path


class CheckpointManager:
    """Create, publish, find and prune atomic checkpoints under ``root``.

    Args:
        root: directory holding ``global_step_N`` checkpoints (created if missing).
        keep_last: number of complete checkpoints to keep (None keeps all).
    """

    def __init__(self, root: str | os.PathLike, keep_last: int | None = None):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"trainer.max_ckpt_to_keep must be >= 1 or null, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last

    #: Checkpoints verified with checksums in this process: (path, manifest mtime and size).
    _verified: set[tuple[Path, int, int]] = set()

    def begin(self, step: int) -> PendingCheckpoint:
        """Start a checkpoint for ``step`` in a fresh hidden ``.incomplete-`` directory
        (:func:`~megaflow.utils.atomic_dir.temporary_sibling` of ``global_step_<step>``)."""
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        self.root.mkdir(parents=True, exist_ok=True)
        path = temporary_sibling(self.root / f"global_step_{step}")
        path.mkdir()
        return PendingCheckpoint(step, path)

    def commit(self, pending: PendingCheckpoint, required_parts: tuple[str, ...] = ()) -> Path:
        """Publish ``pending`` (:func:`~megaflow.utils.atomic_dir.commit_directory`: manifest,
        COMPLETE, fsync, rename; an older save of the same step is replaced), then update
        ``latest`` and prune.

        Raises:
            FileNotFoundError: a required part (file or directory under the checkpoint) is
                missing; the checkpoint stays partial.
        """
        missing = [p for p in required_parts if not (pending.path / p).exists()]
        if missing:
            raise FileNotFoundError(f"checkpoint {pending.path} lacks parts {missing}; not published")
        marker = {"step": pending.step, "time": time.time(),
                  "parts": sorted(p.name for p in pending.path.iterdir())}
        final = commit_directory(pending.path, self.root / f"global_step_{pending.step}", marker)
        atomic_write_text(self.root / "latest", final.name + "\n")
        self._prune()
        return final

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir() and (p / COMPLETE_MARKER).is_file():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None. Partial directories are never returned."""
        found = self.complete_checkpoints()
        return found[-1][1] if found else None

    def skipped_newer(self, step: int) -> list[tuple[Path, str]]:
        """What ``resume=auto`` passes over to resume at ``step`` (-1: none is complete):
        each newer ``global_step_N`` directory that is not complete, or a save in progress or
        interrupted (``.incomplete-``), with the reason, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            final = final_name_of(p)
            if m and int(m.group(1)) > step and not (p / COMPLETE_MARKER).is_file():
                found.append((int(m.group(1)), p, f"no {COMPLETE_MARKER} marker: a damaged or unfinished save"))
            elif final is not None and (fm := _STEP_DIR.match(final)) and int(fm.group(1)) > step:
                found.append((int(fm.group(1)), p, "a save that was interrupted or is still being written"))
        return [(p, why) for _, p, why in sorted(found)]

    def resolve(self, resume: str) -> Path | None:
        """Map ``trainer.resume`` to a checkpoint: ``disable`` -> None, ``auto`` -> latest
        complete (or None), anything else -> that path, which must be a complete checkpoint.

        Raises:
            FileNotFoundError: an explicit path that does not exist (the message lists the
                valid modes, so a misspelt mode such as ``autoo`` is explained) or is not a
                complete checkpoint (a run directory or ``checkpoints/`` is answered with
                the checkpoint inside it to use).
        """
        if resume == "disable":
            return None
        if resume == "auto":
            return self.latest()
        path = Path(os.path.expanduser(resume))
        if not path.exists():
            raise FileNotFoundError(f"trainer.resume={resume!r} is neither 'auto', 'disable' nor an existing "
                                    "checkpoint directory")
        if not (path / COMPLETE_MARKER).is_file():
            inside = [p for p in (path, path / "checkpoints") if p.is_dir()]
            newest = next((found for p in inside if (found := CheckpointManager(p).latest()) is not None), None)
            hint = f"; the newest complete one inside it is {newest}" if newest is not None else ""
            partial = " (an interrupted save)" if final_name_of(path) is not None else ""
            raise FileNotFoundError(f"trainer.resume={resume!r} is not a complete checkpoint{partial}: no "
                                    f"{COMPLETE_MARKER} marker in it{hint}")
        return path

    def remove_partials(self) -> list[Path]:
        """Delete the ``.incomplete-`` directories of saves that never completed (a crash or
        a kill during a save) and stray temporary ``latest`` files; returns what was removed.

        Call it only while holding the run directory's lock (:mod:`megaflow.utils.run_lock`;
        the trainer does, at start-up, before this run saves anything): a save in progress of
        another run writing the same directory would be removed too.
        """
        removed = remove_temporary_siblings(self.root)
        if self.root.is_dir():
            for p in sorted(self.root.glob(".latest.tmp-*")):
                if p.is_file():
                    p.unlink(missing_ok=True)
                    removed.append(p)
        return sorted(removed)

    def verify(self, path: str | os.PathLike, *, checksums: bool = True) -> None:
        """Check a complete checkpoint before anything reads it: every file against its
        manifest (sealed model parts included) and every pickle of its distributed
        checkpoints with restricted readers (no code runs).

        A checkpoint verified (with checksums) once in this process is not verified again
        while its manifest is unchanged (the controller checks it before Ray starts; the
        trainer's resume then reads it).

        Raises:
            IntegrityError: naming the missing, unlisted, changed or refused file.
        """
        path = Path(path)
        manifest = path / "MANIFEST.json"
        stat = manifest.stat() if manifest.is_file() else None
        key = (path.resolve(), stat.st_mtime_ns, stat.st_size) if stat is not None else None
        if key in CheckpointManager._verified:
            return
        verify_manifest(path, checksums=checksums)
        for metadata in sorted(path.rglob(".metadata")):
            check_dcp_pickles(metadata.parent)
        for tensors in sorted(path.rglob("*.pt")):
            load_tensors(tensors)
        if checksums and key is not None:
            CheckpointManager._verified.add(key)

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        for _, path in self.complete_checkpoints()[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)


def write_trainer_state(directory: str | os.PathLike, state: dict[str, Any], tensors: dict[str, Any]) -> None:
    """Write the controller's state: ``state`` (JSON-serialisable) as ``trainer_state.json``
    and ``tensors`` (a flat ``{name: torch.Tensor}``) as ``rng_state.pt``.

    Raises:
        TypeError: ``state`` holds something JSON cannot represent (never pickled instead).
    """
    import torch

    directory = Path(directory)
    text = json.dumps({"version": TRAINER_STATE_VERSION, **state}, indent=1, sort_keys=True, allow_nan=False)
    (directory / TRAINER_STATE_FILE).write_text(text)
    torch.save(dict(tensors), directory / RNG_STATE_FILE)


def read_trainer_state(directory: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read what :func:`write_trainer_state` wrote: (JSON state, tensors), no code executed.

    Raises:
        IntegrityError: a checkpoint of the older pickled format, a missing or malformed
            file, or a tensor file holding anything but tensors (named).
    """
    directory = Path(directory)
    path = directory / TRAINER_STATE_FILE
    if not path.is_file():
        old = " (it has a pickled trainer_state.pt of an older megaflow, which is not loaded)" \
            if (directory / "trainer_state.pt").exists() else ""
        raise IntegrityError(f"{directory} has no {TRAINER_STATE_FILE}{old}")
    state = read_json(path)
    if not isinstance(state, dict) or state.get("version") != TRAINER_STATE_VERSION:
        raise IntegrityError(f"{path}: unknown trainer state version "
                             f"{state.get('version') if isinstance(state, dict) else None!r} "
                             f"(expected {TRAINER_STATE_VERSION})")
    tensors = load_tensors(directory / RNG_STATE_FILE)
    if not isinstance(tensors, dict):
        raise IntegrityError(f"{directory / RNG_STATE_FILE} holds {type(tensors).__name__}, expected a dict "
                             "of tensors")
    return state, tensors


__all__ = ["CheckpointManager", "PendingCheckpoint", "atomic_write_text", "COMPLETE_MARKER", "IntegrityError",
           "TRAINER_STATE_FILE", "RNG_STATE_FILE", "write_trainer_state", "read_trainer_state"]
