"""A minimal worker role for the launch tests (shipped to Ray actors by value)."""
from __future__ import annotations

import os

from megaflow.single_controller import Dispatch, Worker, register


class PidWorker(Worker):
    """Reports its process id; nothing else."""

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()
