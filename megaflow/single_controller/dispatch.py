"""Dispatch and collect rules as plain functions (no Ray needed to run or test them).

A worker-group call is ``collect(execute(dispatch(args)))``. This module holds the two
pure halves:

* :func:`make_plan` turns the controller's ``(args, kwargs)`` into a
  :class:`DispatchPlan`: which ranks execute, each rank's arguments, which ranks' outputs
  are kept, and how much padding was added;
* :func:`collect` turns the kept outputs (in the plan's collect order) into the value the
  controller gets.

Object-store placement is injected: ``put`` is ``ray.put`` in a worker group and the
identity in tests, so a test can count how often a chunk is put.

Proto modes (``Dispatch.DP_COMPUTE_PROTO`` and ``nd_compute(mesh)``) follow one
rule: pad to a multiple of ``dp_size``, one chunk per dp rank in row order, one
``put`` per chunk shared by every rank of that dp rank, outputs from collect ranks only,
ordered by dp rank, concatenated, unpadded. When the input is a
:class:`~megaflow.single_controller.futures.DataProtoFuture`, chunking happens on the
workers (see :class:`~megaflow.single_controller.futures.FutureChunk`) and each collect
rank reports its own padding with a :class:`ChunkOutput`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from megaflow.protocol import DataProto
from megaflow.single_controller.collect import ChunkOutput, collect_proto
from megaflow.single_controller.decorator import Dispatch, Execute, MethodSpec, NDCompute
from megaflow.single_controller.futures import DataProtoFuture, FutureChunk


class DPInfo(NamedTuple):
    """A rank's place in one named mesh: its data-parallel rank and whether it collects."""

    dp_rank: int
    is_collect: bool


@dataclass(frozen=True)
class MeshInfo:
    """The cached dispatch layout of one named mesh.

    Attributes:
        mesh: mesh name (for messages).
        dp_rank_mapping: global rank -> dp rank, length ``world_size``.
        collect_mask: global rank -> whether the rank's output is collected.

    Raises:
        ValueError: lengths differ, a dp rank is negative or has no rank, or the collect
            ranks do not cover dp ranks ``0..dp_size-1`` exactly once each (names the mesh).
    """

    mesh: str
    dp_rank_mapping: tuple[int, ...]
    collect_mask: tuple[bool, ...]

    def __post_init__(self) -> None:
        mapping, mask = tuple(int(d) for d in self.dp_rank_mapping), tuple(bool(c) for c in self.collect_mask)
        object.__setattr__(self, "dp_rank_mapping", mapping)
        object.__setattr__(self, "collect_mask", mask)
        if not mapping or len(mapping) != len(mask):
            raise ValueError(f"mesh {self.mesh!r}: dp_rank_mapping ({len(mapping)} ranks) and collect_mask "
                             f"({len(mask)} ranks) must be non-empty and of equal length")
        if min(mapping) < 0:
            raise ValueError(f"mesh {self.mesh!r}: negative dp rank in {list(mapping)}")
        dp_size = max(mapping) + 1
        empty = sorted(set(range(dp_size)) - set(mapping))
        if empty:
            raise ValueError(f"mesh {self.mesh!r}: dp ranks {empty} have no rank (mapping {list(mapping)})")
        collected = sorted(d for d, c in zip(mapping, mask, strict=True) if c)
        if collected != list(range(dp_size)):
            raise ValueError(f"mesh {self.mesh!r}: the collect ranks must cover dp ranks 0..{dp_size - 1} exactly "
                             f"once each, got dp ranks {collected} (mapping {list(mapping)}, mask {list(mask)})")

    @classmethod
    def from_dp_infos(cls, mesh: str, infos: Sequence[DPInfo]) -> MeshInfo:
        """Build from the per-rank :class:`DPInfo` list (index = global rank)."""
        return cls(mesh, tuple(i.dp_rank for i in infos), tuple(i.is_collect for i in infos))

    @classmethod
    def data_parallel(cls, world_size: int) -> MeshInfo:
        """The ``DP_COMPUTE_PROTO`` layout: rank ``r`` is dp rank ``r`` and collects."""
        return cls("<data parallel>", tuple(range(world_size)), (True,) * world_size)

    @property
    def world_size(self) -> int:
        return len(self.dp_rank_mapping)

    @property
    def dp_size(self) -> int:
        return max(self.dp_rank_mapping) + 1

    @property
    def collect_ranks(self) -> tuple[int, ...]:
        """Collect ranks ordered by their dp rank (index ``d`` = the rank that returns chunk ``d``)."""
        by_dp = {d: r for r, (d, c) in enumerate(zip(self.dp_rank_mapping, self.collect_mask, strict=True)) if c}
        return tuple(by_dp[d] for d in range(self.dp_size))


@dataclass(frozen=True)
class DispatchPlan:
    """What to send where, and how to read the answers.

    Attributes:
        ranks: executing global ranks, ascending.
        args / kwargs: per executing rank (aligned with ``ranks``).
        keep_output: per executing rank; False tells the worker to return None (its output
            would be discarded by :func:`collect` anyway, so it is never transferred).
        collect_ranks: ranks whose outputs :func:`collect` takes, in collect order.
        kind: ``"list"`` (per-rank list), ``"single"`` (one value) or ``"proto"``.
        pad_size: rows of padding added (proto); None when workers report it (future input).
        num_rows: rows after padding (proto, concrete input); None otherwise.
    """

    ranks: tuple[int, ...]
    args: list[tuple]
    kwargs: list[dict]
    keep_output: tuple[bool, ...]
    collect_ranks: tuple[int, ...]
    kind: str
    pad_size: int | None = 0
    num_rows: int | None = None


def _identity(x: Any) -> Any:
    return x


def _is_bulky(x: Any) -> bool:
    return isinstance(x, (DataProto, torch.Tensor, np.ndarray))


def plan_one_to_all(world_size: int, args: tuple, kwargs: dict, put: Callable[[Any], Any] = _identity,
                    rank_zero: bool = False) -> DispatchPlan:
    """Same arguments to every rank (or rank 0 only); bulky arguments are put once and shared."""
    args = tuple(put(a) if _is_bulky(a) else a for a in args)
    kwargs = {k: put(v) if _is_bulky(v) else v for k, v in kwargs.items()}
    ranks = (0,) if rank_zero else tuple(range(world_size))
    return DispatchPlan(ranks, [args] * len(ranks), [kwargs] * len(ranks), (True,) * len(ranks), ranks,
                        "single" if rank_zero else "list")


def check_proto_arguments(args: tuple, kwargs: dict, method: str = "method") -> list[tuple[int | str, Any]]:
    """The ``(position or name, value)`` pairs of a proto-dispatched call, type-checked.

    Raises:
        TypeError: no argument, a value that is neither DataProto nor DataProtoFuture
            (names the argument), or a mix of both.
    """
    items: list[tuple[int | str, Any]] = list(enumerate(args)) + list(kwargs.items())
    if not items:
        raise TypeError(f"{method} uses a proto dispatch and needs at least one DataProto argument")
    for key, value in items:
        if not isinstance(value, (DataProto, DataProtoFuture)):
            name = f"argument {key}" if isinstance(key, int) else f"argument {key!r}"
            raise TypeError(f"{method} uses a proto dispatch: {name} must be a DataProto or a DataProtoFuture, "
                            f"got {type(value).__name__} (put other settings in DataProto.meta_info)")
    kinds = {isinstance(v, DataProtoFuture) for _, v in items}
    if len(kinds) > 1:
        raise TypeError(f"{method}: mixing DataProto and DataProtoFuture arguments in one call is not supported; "
                        f"call .get() on the future or pass futures only")
    return items


def _chunk_concrete(items: list[tuple[int | str, Any]], dp_size: int, put: Callable[[Any], Any],
                    method: str) -> tuple[dict, int, int]:
    lengths = {key: len(value) for key, value in items}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"{method}: DataProto arguments have different row counts {lengths}")
    num_rows = next(iter(lengths.values()))
    if num_rows == 0:
        raise ValueError(f"{method}: cannot dispatch an empty DataProto")
    chunk_refs, pad_size = {}, 0
    for key, value in items:
        padded, pad_size = value.pad_to_divisor(dp_size)
        chunk_refs[key] = [put(c) for c in padded.chunk(dp_size)]
    return chunk_refs, pad_size, num_rows + pad_size


def plan_proto(mesh: MeshInfo, args: tuple, kwargs: dict, put: Callable[[Any], Any] = _identity,
               method: str = "method") -> DispatchPlan:
    """Split DataProto arguments by dp rank (the proto-mode rule in the module docstring).

    Args:
        mesh: the dispatch layout (:meth:`MeshInfo.data_parallel` for ``DP_COMPUTE_PROTO``).
        args / kwargs: every value a DataProto (all of the same length) or every value a
            DataProtoFuture.
        put: called once per chunk and argument (``ray.put`` in a group); its result is
            sent to every rank of that chunk's dp rank.
        method: name used in error messages.

    Raises:
        TypeError: a non-DataProto argument, no argument, or a DataProto/future mix.
        ValueError: DataProto arguments of different lengths, or an empty DataProto.
    """
    items = check_proto_arguments(args, kwargs, method)
    dp_size = mesh.dp_size
    if isinstance(items[0][1], DataProtoFuture):
        chunk_refs = {key: [FutureChunk(value, dp_size, d) for d in range(dp_size)] for key, value in items}
        pad_size, num_rows = None, None
    else:
        chunk_refs, pad_size, num_rows = _chunk_concrete(items, dp_size, put, method)
    ranks = tuple(range(mesh.world_size))
    per_args = [tuple(chunk_refs[i][mesh.dp_rank_mapping[r]] for i in range(len(args))) for r in ranks]
    per_kwargs = [{k: chunk_refs[k][mesh.dp_rank_mapping[r]] for k in kwargs} for r in ranks]
    return DispatchPlan(ranks, per_args, per_kwargs, mesh.collect_mask, mesh.collect_ranks, "proto",
                        pad_size, num_rows)


def make_plan(spec: MethodSpec, world_size: int, args: tuple, kwargs: dict, mesh: MeshInfo | None = None,
              put: Callable[[Any], Any] = _identity, method: str = "method") -> DispatchPlan:
    """The :class:`DispatchPlan` of one call of a method registered with ``spec``.

    ``mesh`` is required for ``nd_compute`` modes (the cached layout of that mesh).
    """
    mode = spec.dispatch_mode
    if mode is Dispatch.ONE_TO_ALL or mode is Dispatch.RANK_ZERO:
        return plan_one_to_all(world_size, args, kwargs, put, rank_zero=spec.execute_mode is Execute.RANK_ZERO)
    if mode is Dispatch.DP_COMPUTE_PROTO:
        return plan_proto(MeshInfo.data_parallel(world_size), args, kwargs, put, method)
    if isinstance(mode, NDCompute):
        if mesh is None or mesh.world_size != world_size:
            raise ValueError(f"{method}: nd_compute({mode.mesh!r}) needs the mesh layout of all {world_size} ranks")
        return plan_proto(mesh, args, kwargs, put, method)
    raise TypeError(f"{method}: unknown dispatch mode {mode!r}")


def collect(plan: DispatchPlan, outputs: Sequence[Any], method: str = "method") -> Any:
    """The controller's value from the outputs of ``plan.collect_ranks`` (in that order)."""
    if len(outputs) != len(plan.collect_ranks):
        raise ValueError(f"{method}: expected {len(plan.collect_ranks)} outputs, got {len(outputs)}")
    if plan.kind == "single":
        return outputs[0]
    if plan.kind == "list":
        return list(outputs)
    return collect_proto(outputs, plan.pad_size, plan.num_rows, method)


__all__ = ["DPInfo", "ChunkOutput", "MeshInfo", "DispatchPlan", "make_plan", "collect", "collect_proto",
           "check_proto_arguments",
           "plan_one_to_all", "plan_proto"]
