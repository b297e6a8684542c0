"""Futures of group calls and how workers resolve them, plus the one way we wait on refs.

A non-blocking call of a proto-dispatched method (``blocking=False``) returns a
:class:`DataProtoFuture`: the object refs of every rank's output, which of them are the
collect ranks (in dp order), and the padding to remove. Nothing is fetched.

Passing a future to the next group call never routes data through the controller:

* ``ONE_TO_ALL`` / ``RANK_ZERO``: the future itself is sent; the worker calls ``get()``.
  Non-blocking calls of these modes return a :class:`GroupFuture` (``get()`` gives what
  the blocking call returns: the per-rank list, or rank 0's value).
* proto dispatch (``DP_COMPUTE_PROTO``, ``nd_compute``): each rank receives a
  :class:`FutureChunk` ``(future, num_chunks, index)`` and the worker cuts its chunk on
  arrival. Fast path: when the producer added no padding and produced exactly
  ``num_chunks`` chunks, the worker fetches only the producer's chunk ``index`` (each
  producer chunk is read once per consumer rank of that dp rank, straight from the
  object store). Otherwise the worker fetches the whole batch, pads it to a multiple of
  ``num_chunks`` and keeps chunk ``index``; it then reports its chunk's padding with a
  :class:`~megaflow.single_controller.dispatch.ChunkOutput` so that the consumer's
  collect can unpad without the controller ever knowing the batch size.

Waiting (:func:`get_all`) polls with ``ray.wait`` so that a rank that fails while its
peers block in a collective raises at once (as a
:class:`~megaflow.single_controller.errors.WorkerError` naming role and rank) instead
of hanging until the collective times out.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError

from megaflow.protocol import DataProto
from megaflow.single_controller.collect import ChunkOutput, collect_proto
from megaflow.single_controller.errors import WorkerError

#: Seconds between early-failure checks while waiting for a group call.
POLL_S = 0.5


def _as_worker_error(exc: BaseException, where: str, method: str) -> WorkerError:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, WorkerError):
        return WorkerError(*cause.args)
    if isinstance(exc, WorkerError):
        return WorkerError(*exc.args)
    if isinstance(exc, RayActorError):
        return WorkerError(where, method, f"the worker process died or was killed:\n{exc}")
    return WorkerError(where, method, f"{type(exc).__name__}: {exc}")


def _get(refs: Sequence[ray.ObjectRef], where: Sequence[str], method: str) -> list[Any]:
    """One ``ray.get`` on ready refs; on failure, find the failing rank and name it."""
    try:
        return ray.get(list(refs))
    except RayError:
        for ref, label in zip(refs, where, strict=True):  # error path only: find the rank that failed
            try:
                ray.get(ref, timeout=0)
            except RayError as exc:
                raise _as_worker_error(exc, label, method) from None
        raise


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this machine has exited (or is a zombie)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def _local_process_gone(node_ip: str, pid: int) -> bool:
    """:func:`process_gone` for a rank on this node; False for other nodes."""
    from ray.util import get_node_ip_address

    return node_ip in ("127.0.0.1", "localhost", get_node_ip_address()) and process_gone(pid)


def get_all(refs: Sequence[ray.ObjectRef], where: Sequence[str], method: str,
            fetch: Sequence[int] | None = None, check: Collection[int] | None = None,
            poll_s: float = POLL_S, processes: Sequence[tuple[str, int]] | None = None) -> list[Any]:
    """Wait for every ref, fail fast on the first worker error, return the fetched values.

    Args:
        refs: one ref per executing rank.
        where: per ref, the description used in errors (role, rank, node).
        method: method name used in errors.
        fetch: indices of refs whose values are returned (default all), in that order.
        check: indices whose values are fetched too (early while other ranks still run,
            or at the end) so that their failures surface; default all. Leave out large
            outputs that this caller does not need (their consumers see their errors).
        poll_s: seconds between failure checks.
        processes: per ref, the ``(node ip, pid)`` of the rank's process. Ranks on this
            machine whose process has exited fail the call at the next poll, without waiting
            for Ray: a process that forked helpers (megatron-core's checkpoint writers)
            keeps its sockets open through them, and Ray then notices its death only when
            they exit, minutes later.

    Raises:
        WorkerError: a rank raised or its process died (the first one detected).
    """
    index_of = {ref: i for i, ref in enumerate(refs)}
    fetch = list(range(len(refs))) if fetch is None else list(fetch)
    check = set(range(len(refs))) if check is None else set(check)
    values: dict[int, Any] = {}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s, fetch_local=False)
        early = [index_of[r] for r in ready if index_of[r] in check]
        if pending and early:  # some ranks are done, others still run: did a done one fail?
            values.update(zip(early, _get([refs[i] for i in early], [where[i] for i in early], method), strict=True))
        if pending and processes is not None:
            for i in (index_of[r] for r in pending):
                if _local_process_gone(*processes[i]):
                    raise WorkerError(where[i], method, f"the worker process died or was killed: pid "
                                                        f"{processes[i][1]} on this node has exited")
    missing = [i for i in sorted(check | set(fetch)) if i not in values]
    values.update(zip(missing, _get([refs[i] for i in missing], [where[i] for i in missing], method), strict=True))
    return [values[i] for i in fetch]


class DataProtoFuture:
    """The pending result of a non-blocking proto-dispatched call.

    Pass it as an argument to the next group call (the workers resolve it), or call
    :meth:`get` to materialise it where you are.

    Args:
        refs: per executing rank, the ref of its output (None values for non-collect ranks).
        where: per rank, its description for error messages.
        collect_index: indices into ``refs`` of the collect ranks, ordered by dp rank.
        pad_size: padding rows to drop after concatenation (None: reported by workers).
        num_rows: rows after padding (None when unknown).
        method: ``"role.method"`` that produced it (for messages).
    """

    def __init__(self, refs: Sequence[ray.ObjectRef], where: Sequence[str], collect_index: Sequence[int],
                 pad_size: int | None, num_rows: int | None, method: str) -> None:
        self.refs, self.where = list(refs), list(where)
        self.collect_index = list(collect_index)
        self.pad_size, self.num_rows, self.method = pad_size, num_rows, method

    @property
    def num_chunks(self) -> int:
        """Number of chunks (the producer's dp size)."""
        return len(self.collect_index)

    def get(self) -> Any:
        """Wait for all ranks and return the collected value (DataProto, GroupProtoResult, or
        per-dp-rank list; see :func:`~megaflow.single_controller.collect.collect_proto`).

        Raises:
            WorkerError: a rank of the producing call failed.
        """
        values = get_all(self.refs, self.where, self.method, fetch=self.collect_index)
        return collect_proto(values, self.pad_size, self.num_rows, self.method)

    def get_chunk(self, index: int) -> Any:
        """Wait for all ranks and return only dp chunk ``index`` (no other chunk is fetched)."""
        collect = set(self.collect_index)
        check = [i for i in range(len(self.refs)) if i not in collect] + [self.collect_index[index]]
        return get_all(self.refs, self.where, self.method, fetch=[self.collect_index[index]], check=check)[0]

    def __repr__(self) -> str:
        return f"DataProtoFuture({self.method}, chunks={self.num_chunks}, pad_size={self.pad_size})"


class GroupFuture:
    """The pending result of a non-blocking ``ONE_TO_ALL`` or rank-zero call.

    Args:
        refs: per executing rank, the ref of its output.
        where: per rank, its description for error messages.
        method: ``"role.method"`` that produced it.
        single: the call returns one value (rank zero) rather than the per-rank list.
        processes: per rank, ``(node ip, pid)`` for the early death check of :func:`get_all`.
    """

    def __init__(self, refs: Sequence[ray.ObjectRef], where: Sequence[str], method: str, *, single: bool,
                 processes: Sequence[tuple[str, int]] | None = None) -> None:
        self.refs, self.where, self.method, self.single = list(refs), list(where), method, single
        self.processes = None if processes is None else list(processes)

    def done(self) -> bool:
        """Whether every rank has finished (successfully or not); does not wait."""
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0, fetch_local=False)
        return len(ready) == len(self.refs)

    def get(self) -> Any:
        """Wait for every rank; the blocking call's value (per-rank list, or rank 0's value).

        Raises:
            WorkerError: a rank raised or its process died.
        """
        values = get_all(self.refs, self.where, self.method, processes=self.processes)
        return values[0] if self.single else values

    def __repr__(self) -> str:
        return f"GroupFuture({self.method}, ranks={len(self.refs)})"

    @staticmethod
    def get_together(futures: Sequence[GroupFuture]) -> list[Any]:
        """Wait for calls that depend on each other (e.g. the two sides of a collective
        spanning two groups) as one: the first rank to fail, in any of them, raises at once
        instead of leaving the others blocked in the collective.

        Returns:
            Each future's value (as :meth:`get`), in order.

        Raises:
            WorkerError: a rank of any of the calls raised or died.
        """
        refs = [r for f in futures for r in f.refs]
        where = [w for f in futures for w in f.where]
        processes: list[tuple[str, int]] | None = None
        if all(f.processes is not None for f in futures):
            processes = [p for f in futures for p in f.processes or ()]
        values = get_all(refs, where, " + ".join(f.method for f in futures), processes=processes)
        out, start = [], 0
        for f in futures:
            chunk = values[start:start + len(f.refs)]
            out.append(chunk[0] if f.single else chunk)
            start += len(f.refs)
        return out


@dataclass(frozen=True)
class FutureChunk:
    """Chunk ``index`` of ``num_chunks`` of a :class:`DataProtoFuture`, cut by the worker."""

    source: DataProtoFuture
    num_chunks: int
    index: int

    def resolve(self) -> tuple[Any, int, int]:
        """Fetch and cut the chunk; returns ``(DataProto chunk, num_rows, num_pad_rows)``.

        Raises:
            TypeError: the future does not hold a DataProto.
            WorkerError: the producing call failed.
        """
        source = self.source
        if source.pad_size == 0 and source.num_chunks == self.num_chunks:
            chunk = _unwrap(source.get_chunk(self.index))
            _require_proto(chunk, source)
            return chunk, len(chunk), 0
        full = source.get()
        _require_proto(full, source)
        padded, _ = full.pad_to_divisor(self.num_chunks)
        size = len(padded) // self.num_chunks
        num_pad_rows = max(0, min(size, (self.index + 1) * size - len(full)))
        return padded.chunk(self.num_chunks)[self.index], size, num_pad_rows


def _unwrap(value: Any) -> Any:
    return value.value if isinstance(value, ChunkOutput) else value


def _require_proto(value: Any, source: DataProtoFuture) -> None:
    if not isinstance(value, DataProto):
        raise TypeError(f"{source.method} returned {type(value).__name__}, but the call it was passed to splits "
                        f"a DataProto by dp rank")


def resolve_arguments(args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple[int, int] | None]:
    """Worker side: replace futures in the top-level arguments by their values.

    Returns:
        ``(args, kwargs, chunk_report)`` where ``chunk_report`` is ``(num_rows,
        num_pad_rows)`` of the chunk when any argument was a :class:`FutureChunk`, else None.

    Raises:
        ValueError: several future chunks of one call disagree on their size.
    """
    reports: set[tuple[int, int]] = set()

    def resolve(value: Any) -> Any:
        if isinstance(value, FutureChunk):
            chunk, num_rows, num_pad_rows = value.resolve()
            reports.add((num_rows, num_pad_rows))
            return chunk
        if isinstance(value, (DataProtoFuture, GroupFuture)):
            return value.get()
        return value

    args = tuple(resolve(a) for a in args)
    kwargs = {k: resolve(v) for k, v in kwargs.items()}
    if len(reports) > 1:
        raise ValueError(f"future arguments of one call give chunks of different sizes {sorted(reports)}; "
                         f"pass futures of equally long batches")
    return args, kwargs, (reports.pop() if reports else None)


__all__ = ["DataProtoFuture", "GroupFuture", "FutureChunk", "get_all", "resolve_arguments", "POLL_S"]
