"""``@register``: declare how a worker method is called from the controller.

A worker class marks the methods that the controller may call with :func:`register`. A
worker group (:class:`~megaflow.single_controller.worker_group.RayWorkerGroup`) runs a
marked method by name (``group.call(name, ...)``, reached from the controller through the
typed proxies of :mod:`megaflow.trainer.proxies`) as ``collect(execute(dispatch(args)))``:

* **dispatch** turns the controller's arguments into per-rank arguments
  (:class:`Dispatch` or :func:`nd_compute`);
* **execute** runs the method on all ranks or on rank 0 only (:class:`Execute`);
* **collect** turns the per-rank outputs into the value the controller gets.

The rules themselves are plain functions in :mod:`megaflow.single_controller.dispatch`.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: Attribute under which :func:`register` stores a method's :class:`MethodSpec`.
SPEC_ATTR = "__megaflow_method_spec__"


class Dispatch(enum.Enum):
    """How the controller's arguments are distributed to the ranks of a group.

    * ``ONE_TO_ALL``: every rank gets the same arguments; the group returns the list of
      per-rank outputs (index = rank). For init, load, save and queries.
    * ``RANK_ZERO``: the arguments go unchanged to rank 0 only, which alone executes; the
      group returns rank 0's output.
    * ``DP_COMPUTE_PROTO``: every rank is one data-parallel slot. Every argument must be a
      :class:`~megaflow.protocol.DataProto` (or a future of one); the batch is padded to a
      multiple of ``world_size``, split into ``world_size`` chunks in row order, and the
      outputs are concatenated in rank order and unpadded. Equivalent to
      :func:`nd_compute` on a mesh where rank ``r`` has ``dp_rank == r`` and every rank
      collects.
    """

    ONE_TO_ALL = "one_to_all"
    RANK_ZERO = "rank_zero"
    DP_COMPUTE_PROTO = "dp_compute_proto"


class Execute(enum.Enum):
    """Which ranks execute: ``ALL`` (every rank) or ``RANK_ZERO`` (rank 0 only)."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class NDCompute:
    """The Megatron dispatch rule for a named mesh; see :func:`nd_compute`."""

    mesh: str


DispatchMode = Dispatch | NDCompute


def nd_compute(mesh: str) -> NDCompute:
    """Dispatch mode for a Megatron TP x PP x (CP x) DP mesh named ``mesh``.

    Every worker registers its place in the mesh with
    :meth:`Worker.register_dp_info(mesh, dp_rank=..., is_collect=...)
    <megaflow.single_controller.worker.Worker.register_dp_info>` before the first call.
    The group queries all ranks once per mesh and caches ``dp_rank_mapping`` (global rank
    -> dp rank) and ``collect_mask`` (global rank -> bool). A call then pads the batch to a
    multiple of ``dp_size = max(dp_rank_mapping) + 1``, splits it into ``dp_size`` chunks,
    puts each chunk in the object store once and sends the same reference to every rank of
    that dp rank (all TP/PP/CP peers of one replica); outputs are taken only from collect
    ranks, ordered by dp rank, concatenated and unpadded.

    Raises:
        ValueError: ``mesh`` is not a non-empty string.
    """
    if not isinstance(mesh, str) or not mesh:
        raise ValueError(f"nd_compute(mesh=...) needs a non-empty mesh name, got {mesh!r}")
    return NDCompute(mesh)


@dataclass(frozen=True)
class MethodSpec:
    """How one registered method is dispatched, executed and collected.

    Attributes:
        dispatch_mode: a :class:`Dispatch` member or an :class:`NDCompute` mode.
        execute_mode: :class:`Execute` member.
        blocking: True: the group call returns the collected value. False: it returns a
            future (see :mod:`megaflow.single_controller.futures`).
    """

    dispatch_mode: DispatchMode
    execute_mode: Execute
    blocking: bool

    @property
    def is_proto(self) -> bool:
        """True for the modes that split a DataProto by data-parallel rank."""
        return self.dispatch_mode is Dispatch.DP_COMPUTE_PROTO or isinstance(self.dispatch_mode, NDCompute)


def _validate(dispatch_mode: Any, execute_mode: Any, blocking: Any) -> MethodSpec:
    if not isinstance(dispatch_mode, (Dispatch, NDCompute)):
        raise TypeError(f"dispatch_mode must be a Dispatch member or nd_compute(mesh), got {dispatch_mode!r}; "
                        f"valid: {[m.name for m in Dispatch]} or nd_compute('<mesh>')")
    if execute_mode is None:
        execute_mode = Execute.RANK_ZERO if dispatch_mode is Dispatch.RANK_ZERO else Execute.ALL
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"execute_mode must be an Execute member, got {execute_mode!r}; "
                        f"valid: {[m.name for m in Execute]}")
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking must be a bool, got {blocking!r}")
    if execute_mode is Execute.RANK_ZERO and dispatch_mode not in (Dispatch.ONE_TO_ALL, Dispatch.RANK_ZERO):
        raise ValueError(f"execute_mode=Execute.RANK_ZERO only combines with Dispatch.ONE_TO_ALL or "
                         f"Dispatch.RANK_ZERO, not {dispatch_mode!r}")
    if dispatch_mode is Dispatch.RANK_ZERO and execute_mode is not Execute.RANK_ZERO:
        raise ValueError("Dispatch.RANK_ZERO runs on rank 0 only; execute_mode must be Execute.RANK_ZERO")
    return MethodSpec(dispatch_mode, execute_mode, blocking)


def register(dispatch_mode: DispatchMode = Dispatch.ONE_TO_ALL, execute_mode: Execute | None = None,
             blocking: bool = True) -> Callable[[F], F]:
    """Mark a worker method as callable from the controller through a worker group.

    The method itself is returned unchanged (calling it inside the worker is a plain
    call); only a :class:`MethodSpec` is attached to it.

    Args:
        dispatch_mode: a :class:`Dispatch` member or ``nd_compute(mesh)``.
        execute_mode: :class:`Execute` member; default ``Execute.ALL``
            (``Execute.RANK_ZERO`` for ``Dispatch.RANK_ZERO``).
        blocking: when False ``group.call`` returns without waiting: a
            :class:`~megaflow.single_controller.futures.GroupFuture` (ONE_TO_ALL /
            rank zero) or a
            :class:`~megaflow.single_controller.futures.DataProtoFuture` (proto modes),
            either of which can be passed to the next group call. Any registered method
            can also be started without waiting, call by call, with
            :meth:`RayWorkerGroup.submit <megaflow.single_controller.worker_group.RayWorkerGroup.submit>`.

    Raises:
        TypeError: a mode of the wrong type, or ``@register`` used without parentheses.
        ValueError: an incompatible dispatch/execute combination.
    """
    if callable(dispatch_mode) and not isinstance(dispatch_mode, (Dispatch, NDCompute)):
        raise TypeError("use @register(...) with parentheses, e.g. @register(Dispatch.ONE_TO_ALL)")
    spec = _validate(dispatch_mode, execute_mode, blocking)

    def decorate(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"@register decorates methods, got {fn!r}")
        setattr(fn, SPEC_ATTR, spec)
        return fn

    return decorate


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Name -> :class:`MethodSpec` of every ``@register``-ed method of ``cls`` (inherited included)."""
    methods: dict[str, MethodSpec] = {}
    for name in dir(cls):
        if name.startswith("__"):
            continue
        spec = getattr(getattr(cls, name, None), SPEC_ATTR, None)
        if isinstance(spec, MethodSpec):
            methods[name] = spec
    return methods


__all__ = ["Dispatch", "Execute", "NDCompute", "DispatchMode", "MethodSpec", "nd_compute", "register",
           "registered_methods"]
