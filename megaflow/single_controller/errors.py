"""Errors that a worker group raises on the controller."""
from __future__ import annotations


class WorkerError(RuntimeError):
    """A worker method (or a worker process) failed; names the role, rank and method.

    Raised on the controller by blocking group calls and by ``DataProtoFuture.get()``.
    The worker's own traceback is in the message and in :attr:`remote_traceback`.

    All fields travel in ``args`` so that the exception survives pickling through Ray.

    Attributes:
        where: ``"role 'actor' (ActorWorker) rank 3 (node 10.0.0.2, pid 4242)"``.
        method: the worker method that failed (``"compute_log_prob"``, ``"__init__"``).
        remote_traceback: the formatted traceback from the worker process.
        role: role name, or None when unknown.
        rank: global rank in the group, or None when unknown.
    """

    def __init__(self, where: str, method: str, remote_traceback: str, role: str | None = None,
                 rank: int | None = None) -> None:
        super().__init__(where, method, remote_traceback, role, rank)
        self.where, self.method, self.remote_traceback = where, method, remote_traceback
        self.role, self.rank = role, rank

    def __str__(self) -> str:
        return f"{self.method} failed on {self.where}:\n{self.remote_traceback.rstrip()}"


__all__ = ["WorkerError"]
