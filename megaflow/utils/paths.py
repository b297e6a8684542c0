"""Whether an output path can be created, checked before anything is written."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def why_not_creatable(path: str | os.PathLike) -> str | None:
    """Why the directory ``path`` (and its missing parents) cannot be created, or None.

    Looks at the nearest ancestor that exists: it must be a directory that this process
    may write into, tried by creating and removing an empty directory in it (so that
    pseudo file systems such as ``/proc`` are found out). Nothing is left behind.

    Returns:
        e.g. ``"/dev/null is not a directory"`` or ``"/root is not writable"``; None when
        ``path`` is a writable directory or can be made.
    """
    path = Path(path).expanduser().absolute()
    probe = path
    while not os.path.lexists(probe) and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    try:  # access() says yes for root everywhere, /proc and /sys included: try an entry
        os.rmdir(tempfile.mkdtemp(prefix=".megaflow-probe-", dir=probe))
    except OSError as exc:
        return f"{probe} takes no new directory ({exc.strerror})"
    return None


__all__ = ["why_not_creatable"]
