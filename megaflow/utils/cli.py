"""Expected errors of command-line tools as one line and exit code 2, not a traceback."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable

#: Set to 1 to see the traceback of an expected error too (it is re-raised).
DEBUG_ENV = "MEGAFLOW_DEBUG"
#: Exit code of an expected input error (bad argument, missing/corrupt file, existing output).
EXIT_INPUT_ERROR = 2


def debug_enabled() -> bool:
    """Whether ``MEGAFLOW_DEBUG`` asks for tracebacks of expected errors."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def run_tool(fn: Callable[[], int | None], *, expected: tuple[type[BaseException], ...] = (ValueError, OSError),
             stream=None) -> int:
    """Run a tool's body; an ``expected`` exception becomes ``error: <message>`` on stderr
    and exit code 2 (re-raised when :func:`debug_enabled`). Anything else propagates.

    Returns:
        ``fn()``'s exit code (0 when it returns None), or 2.
    """
    try:
        rc = fn()
    except expected as exc:
        if debug_enabled():
            raise
        print(f"error: {exc}", file=stream or sys.stderr)
        return EXIT_INPUT_ERROR
    return 0 if rc is None else rc


__all__ = ["run_tool", "debug_enabled", "DEBUG_ENV", "EXIT_INPUT_ERROR"]
