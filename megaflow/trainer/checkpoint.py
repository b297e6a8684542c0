"""Atomic checkpoint directories for the controller and its worker groups.

Layout under ``root`` (the run's ``checkpoints/`` directory)::

    global_step_20/            complete checkpoint (renamed into place as the last step)
        COMPLETE               JSON: step, time, parts written; present only when complete
        trainer_state.pt       controller state: step, dataloader position, RNG, KL controller
        config.yaml            the run's resolved config
        actor/ critic/ ...     worker-group parts (megatron-core distributed checkpoints)
    global_step_30.partial-<id>/   a save in progress, or one that crashed: never loaded
    latest                     text file with the name of the newest complete checkpoint

A save writes everything into a ``.partial-`` directory, fsyncs it, writes ``COMPLETE`` and
renames the directory to its final name (atomic on POSIX within one filesystem), then
replaces ``latest`` atomically. A crash at any point leaves the previous checkpoint intact
and the new one unmistakably incomplete (no ``COMPLETE``, a ``.partial-`` name).
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

from megaflow.utils.atomic_dir import fsync_path, fsync_tree

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
COMPLETE_MARKER = "COMPLETE"


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
            raise ValueError(f"trainer.checkpoint_keep_last must be >= 1 or null, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last

    def begin(self, step: int) -> PendingCheckpoint:
        """Start a checkpoint for ``step`` in a fresh ``.partial-`` directory."""
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"global_step_{step}.partial-{uuid.uuid4().hex[:8]}"
        path.mkdir()
        return PendingCheckpoint(step, path)

    def commit(self, pending: PendingCheckpoint, required_parts: tuple[str, ...] = ()) -> Path:
        """Publish ``pending``: check parts exist, fsync, write COMPLETE, rename, update ``latest``.

        Raises:
            FileNotFoundError: a required part (file or directory under the checkpoint) is
                missing; the checkpoint stays partial.
        """
        missing = [p for p in required_parts if not (pending.path / p).exists()]
        if missing:
            raise FileNotFoundError(f"checkpoint {pending.path} lacks parts {missing}; not published")
        final = self.root / f"global_step_{pending.step}"
        if final.exists():  # an older save of the same step (e.g. after resume): replace it
            shutil.rmtree(final)
        marker = {"step": pending.step, "time": time.time(),
                  "parts": sorted(p.name for p in pending.path.iterdir())}
        fsync_tree(pending.path)
        atomic_write_text(pending.path / COMPLETE_MARKER, json.dumps(marker))
        os.rename(pending.path, final)
        fsync_path(self.root)
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

    def resolve(self, resume: str) -> Path | None:
        """Map ``trainer.resume`` to a checkpoint: ``disable`` -> None, ``auto`` -> latest
        complete (or None), anything else -> that path, which must be a complete checkpoint.

        Raises:
            FileNotFoundError: an explicit path that is not a complete checkpoint.
        """
        if resume == "disable":
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume)
        if not (path / COMPLETE_MARKER).is_file():
            raise FileNotFoundError(f"trainer.resume={resume!r} is not a complete checkpoint "
                                    f"(no {COMPLETE_MARKER} marker in it)")
        return path

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        for _, path in self.complete_checkpoints()[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)


__all__ = ["CheckpointManager", "PendingCheckpoint", "atomic_write_text", "COMPLETE_MARKER"]
