"""Collecting per-dp-rank outputs into one result (shared by the dispatch and the futures).

A collect rank's output is either the method's return value, or a :class:`ChunkOutput`
when the worker cut its own chunk of a future input (it then reports the chunk's rows
and padding). :func:`collect_proto` concatenates DataProto outputs in dp order and removes
the padding. A method that returns metrics beside its rows returns a :class:`ProtoResult`;
the controller then gets a :class:`GroupProtoResult` (the rows collected, the metrics per
dp rank).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megaflow.protocol import DataProto


@dataclass(frozen=True)
class ChunkOutput:
    """A collect rank's output for a chunk that the worker cut itself (future input).

    Attributes:
        value: the method's return value.
        num_rows: rows of the input chunk, padding included.
        num_pad_rows: trailing padding rows of that chunk (to be removed after concat).
    """

    value: Any
    num_rows: int
    num_pad_rows: int


@dataclass(frozen=True)
class ProtoResult:
    """One dp rank's output of a proto method that returns metrics beside its rows.

    Attributes:
        batch: the rank's rows, one per row of its input chunk.
        metrics: the rank's metrics (name -> value).
    """

    batch: DataProto
    metrics: dict[str, float]


@dataclass(frozen=True)
class GroupProtoResult:
    """What the controller gets from a proto method that returns :class:`ProtoResult`.

    Attributes:
        batch: the rows of every dp rank, in dp order, padding removed.
        metrics: each dp rank's metrics, index = dp rank.
    """

    batch: DataProto
    metrics: list[dict[str, float]]


def _concat_unpad(values: Sequence[DataProto], pad_size: int | None, num_rows: int | None,
                  method: str) -> DataProto:
    merged = DataProto.concat(values)
    if pad_size and num_rows is not None and len(merged) != num_rows:
        raise ValueError(f"{method} returned {len(merged)} rows for {num_rows} input rows ({pad_size} of them "
                         f"padding); a proto method on a padded batch must return one row per input row")
    return merged.unpad(pad_size) if pad_size else merged


def collect_proto(outputs: Sequence[Any], pad_size: int | None, num_rows: int | None,
                  method: str = "method") -> Any:
    """Concatenate per-dp-rank outputs (in dp order) and remove the padding.

    DataProto outputs are concatenated and the last ``pad_size`` rows dropped;
    :class:`ProtoResult` outputs give a :class:`GroupProtoResult` (their rows so collected,
    their metrics as a list indexed by dp rank); any other outputs (metrics dicts, say) come
    back as a list indexed by dp rank. Outputs wrapped
    in :class:`ChunkOutput` carry their own padding count (used when ``pad_size`` is None).

    Raises:
        ValueError: with padding, the outputs do not have one row per input row.
    """
    values = [o.value if isinstance(o, ChunkOutput) else o for o in outputs]
    if pad_size is None:
        reports = [o for o in outputs if isinstance(o, ChunkOutput)]
        pad_size = sum(o.num_pad_rows for o in reports)
        num_rows = sum(o.num_rows for o in reports) if len(reports) == len(outputs) else None
    if values and all(isinstance(v, ProtoResult) for v in values):
        return GroupProtoResult(_concat_unpad([v.batch for v in values], pad_size, num_rows, method),
                                [v.metrics for v in values])
    if not values or not all(isinstance(v, DataProto) for v in values):
        return values
    return _concat_unpad(values, pad_size, num_rows, method)


__all__ = ["ChunkOutput", "ProtoResult", "GroupProtoResult", "collect_proto"]
