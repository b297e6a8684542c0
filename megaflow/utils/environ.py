"""Process-environment helpers (standard library only: imported by light entry points)."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def exported_env(env: dict[str, str]) -> Iterator[None]:
    """``env`` (name -> value) in this process's environment for the ``with`` block, then the previous
    values again (processes started inside the block keep ``env``)."""
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


__all__ = ["exported_env"]
