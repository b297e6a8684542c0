"""Output directories that appear complete or not at all: the one protocol of megaflow's
model conversions, prepared models and training checkpoints.

Writers fill a hidden sibling ``.<name>.incomplete-<token>`` (:func:`temporary_sibling`);
:func:`commit_directory` seals it (:func:`seal_directory`: the checksum manifest
``MANIFEST.json``, then the ``COMPLETE`` marker), fsyncs every file, renames the directory
into place (atomic within one POSIX filesystem) and fsyncs the parent. On error the
temporary directory is removed (:func:`atomic_directory`), so a failed conversion leaves
no partial output behind; a killed writer leaves only a hidden ``.incomplete-`` sibling,
which :func:`is_complete` and the readers never accept and
:func:`remove_temporary_siblings` deletes.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

COMPLETE_MARKER = "COMPLETE"
#: Infix of the temporary directory names (``.<name>.incomplete-<token>``).
INCOMPLETE_INFIX = ".incomplete-"


def fsync_path(path: str | os.PathLike) -> None:
    """fsync one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file and directory under ``path``."""
    for dirpath, _, filenames in os.walk(os.fspath(path)):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def check_output_dir(final: str | os.PathLike, overwrite: bool = False) -> Path:
    """Validate that ``final`` may be written; returns it as an absolute Path.

    Raises:
        FileExistsError: ``final`` exists, is not empty and ``overwrite`` is False.
    """
    final = Path(final).absolute()
    if final.exists() and not overwrite and (not final.is_dir() or any(final.iterdir())):
        raise FileExistsError(f"output directory {final} already exists; pass overwrite "
                              "(--overwrite) to replace it")
    return final


def temporary_sibling(final: str | os.PathLike, token: str | None = None) -> Path:
    """The hidden temporary directory name used while writing ``final``."""
    final = Path(final).absolute()
    return final.parent / f".{final.name}{INCOMPLETE_INFIX}{token or uuid.uuid4().hex[:10]}"


def final_name_of(temporary: str | os.PathLike) -> str | None:
    """The final directory name a :func:`temporary_sibling` is written for; None when
    ``temporary`` is not such a name."""
    name = Path(temporary).name
    if not name.startswith(".") or INCOMPLETE_INFIX not in name:
        return None
    return name[1:].rsplit(INCOMPLETE_INFIX, 1)[0] or None


def remove_temporary_siblings(parent: str | os.PathLike) -> list[Path]:
    """Delete the temporary directories left in ``parent`` by writers that never committed
    (a crash or a kill); returns what was removed, sorted. Call it only when no writer is
    active in ``parent``."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    removed = []
    for p in sorted(parent.iterdir()):
        if p.is_dir() and final_name_of(p) is not None:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def seal_directory(directory: str | os.PathLike, marker: dict[str, Any]) -> None:
    """Mark a fully written ``directory`` complete: write its checksum manifest
    (:func:`megaflow.utils.integrity.write_manifest`), then ``COMPLETE`` (JSON ``marker``),
    both fsynced. Nothing may be added to ``directory`` afterwards (verification would
    refuse the unlisted file)."""
    from megaflow.utils.integrity import write_manifest

    directory = Path(directory)
    write_manifest(directory)
    with open(directory / COMPLETE_MARKER, "w") as f:
        json.dump(marker, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def commit_directory(tmp: str | os.PathLike, final: str | os.PathLike,
                     marker: dict[str, Any] | None = None) -> Path:
    """Publish ``tmp`` as ``final`` atomically (an existing ``final`` is replaced).

    Args:
        marker: when given, ``tmp`` is sealed first (:func:`seal_directory`: checksum
            manifest, then ``COMPLETE`` with this JSON) unless it already is.
    """
    tmp, final = Path(tmp), Path(final).absolute()
    if marker is not None and not is_complete(tmp):
        seal_directory(tmp, marker)
    fsync_tree(tmp)
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:10]}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike, *, overwrite: bool = False,
                     marker: dict[str, Any] | None = None) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``final`` when the block succeeds.

    Raises:
        FileExistsError: see :func:`check_output_dir`. Any exception from the block is
            re-raised after the temporary directory has been removed.
    """
    final = check_output_dir(final, overwrite)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(final)
    tmp.mkdir()
    try:
        yield tmp
        commit_directory(tmp, final, marker)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_complete(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` was sealed (published by :func:`commit_directory` with a marker)."""
    return (Path(directory) / COMPLETE_MARKER).is_file()


__all__ = ["COMPLETE_MARKER", "INCOMPLETE_INFIX", "atomic_directory", "check_output_dir", "commit_directory",
           "seal_directory", "temporary_sibling", "final_name_of", "remove_temporary_siblings", "fsync_tree",
           "is_complete"]
