"""DataProto: the batch container that carries a PPO/GRPO step between controller and workers.

A ``DataProto`` has three parts that always describe the same rows:

* ``batch``: a :class:`tensordict.TensorDict` whose single batch dimension is the row
  (sample) index; every tensor field is ``[batch, ...]``.
* ``non_tensor_batch``: a dict of 1-D numpy arrays of ``dtype=object`` with one entry per
  row (uids, raw prompts, ground truths, data sources).
* ``meta_info``: a plain dict for the whole batch (a generate call's sampling parameters,
  the metrics a worker returns with its output).

Standard fields
---------------
The names and shapes below are used across megaflow (``B`` = rows, ``P`` = prompt length,
``R`` = response length, ``S = P + R``). Prompts are left-padded, responses right-padded.

==================== =========== ======== =====================================================
field                shape       dtype    meaning
==================== =========== ======== =====================================================
input_ids            [B, S]      int64    prompt tokens followed by response tokens
attention_mask       [B, S]      int64    1 on real (non-pad) tokens of prompt and response
position_ids         [B, S]      int64    positions of real tokens (cumsum of mask - 1)
prompts              [B, P]      int64    the left-padded prompt part of ``input_ids``
responses            [B, R]      int64    the right-padded response part of ``input_ids``
response_mask        [B, R]      int64    1 on response tokens that count (up to and including
                                          the first EOS; 0 on padding and on tool/observation
                                          tokens); built by position, never by pad-id compare
rollout_log_probs    [B, R]      float32  log-probs of the sampled tokens from the rollout engine
old_log_probs        [B, R]      float32  log-probs under the actor before this step's update
ref_log_probs        [B, R]      float32  log-probs under the frozen reference policy
entropys             [B, R]      float32  per-token entropy of the actor's distribution
values               [B, R]      float32  critic value estimate of each response position
token_level_scores   [B, R]      float32  reward from the reward function/model (usually on the
                                          last valid token)
token_level_rewards  [B, R]      float32  scores with the KL penalty applied (when in reward)
advantages           [B, R]      float32  advantage estimates
returns              [B, R]      float32  return targets for the critic
uid                  [B] object  str      prompt id; GRPO/RLOO groups share one uid
==================== =========== ======== =====================================================

Rows added by :meth:`DataProto.pad_to_divisor` copy real rows (so every forward pass sees
valid inputs) and have their loss-weight fields (:data:`LOSS_WEIGHT_KEYS`) zeroed, so they
carry no weight in any loss; :meth:`DataProto.unpad` removes them again.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

STANDARD_FIELDS: dict[str, str] = {
    "input_ids": "[B, S] int64: prompt then response tokens",
    "attention_mask": "[B, S] int64: 1 on real tokens",
    "position_ids": "[B, S] int64: positions of real tokens",
    "prompts": "[B, P] int64: left-padded prompt tokens",
    "responses": "[B, R] int64: right-padded response tokens",
    "response_mask": "[B, R] int64: 1 on response tokens that count (first EOS kept)",
    "rollout_log_probs": "[B, R] float32: rollout engine log-probs of sampled tokens",
    "old_log_probs": "[B, R] float32: actor log-probs before the update",
    "ref_log_probs": "[B, R] float32: reference policy log-probs",
    "entropys": "[B, R] float32: per-token entropy",
    "values": "[B, R] float32: critic values",
    "token_level_scores": "[B, R] float32: reward-function/model scores",
    "token_level_rewards": "[B, R] float32: scores after the KL penalty",
    "advantages": "[B, R] float32: advantage estimates",
    "returns": "[B, R] float32: critic return targets",
    "uid": "[B] object: prompt id shared by the samples of one group",
}

#: Fields zeroed on rows added by :meth:`DataProto.pad_to_divisor`.
LOSS_WEIGHT_KEYS: tuple[str, ...] = ("response_mask",)

Index = int | slice | torch.Tensor | np.ndarray | Sequence[int]


def _to_object_array(values: Any, key: str) -> np.ndarray:
    """Convert a sequence to a 1-D numpy object array without numpy's nested broadcasting."""
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"non-tensor field {key!r} must be a sequence with one entry per row, "
                        f"got {type(values).__name__}")
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _values_equal(a: Any, b: Any) -> bool:
    try:
        eq = a == b
        if isinstance(eq, np.ndarray):
            return bool(eq.all())
        if isinstance(eq, torch.Tensor):
            return bool(eq.all())
        return bool(eq)
    except Exception:  # noqa: BLE001 - incomparable values count as different
        return False


def _tensor_keys(batch: TensorDict | None) -> list[str]:
    """The tensor field names of ``batch`` (none for None); fields are never nested."""
    return [k for k in batch.keys() if isinstance(k, str)] if batch is not None else []


@dataclass
class DataProto:
    """A batch of rows with tensor fields, per-row Python objects and batch-level metadata.

    Args:
        batch: TensorDict with ``batch_size=[B]`` (or None when there are no tensor fields).
        non_tensor_batch: name -> 1-D numpy object array of length ``B`` (lists are converted).
        meta_info: batch-level plain values.

    Raises:
        ValueError: when the parts disagree on the number of rows, naming the field.
    """

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.batch is not None:
            if not isinstance(self.batch, TensorDict):
                raise TypeError(f"DataProto.batch must be a TensorDict, got {type(self.batch).__name__}")
            if self.batch.batch_dims != 1:
                raise ValueError(f"DataProto.batch must have exactly one batch dimension, "
                                 f"got batch_size={list(self.batch.batch_size)}")
        self.non_tensor_batch = {k: _to_object_array(v, k) for k, v in self.non_tensor_batch.items()}
        self.meta_info = dict(self.meta_info)
        self._check_lengths()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor] | None = None,
                  non_tensors: dict[str, Any] | None = None,
                  meta_info: dict[str, Any] | None = None) -> DataProto:
        """Build from a dict of ``[B, ...]`` tensors and a dict of per-row sequences.

        Raises:
            TypeError: a tensor field that is not a ``torch.Tensor`` (name given).
            ValueError: fields with different leading sizes (names and sizes given).
        """
        tensors = dict(tensors or {})
        batch = None
        if tensors:
            for k, v in tensors.items():
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"tensor field {k!r} must be a torch.Tensor, got {type(v).__name__}")
                if v.dim() == 0:
                    raise ValueError(f"tensor field {k!r} is a scalar; fields need a leading batch dim")
            sizes = {k: v.shape[0] for k, v in tensors.items()}
            if len(set(sizes.values())) != 1:
                raise ValueError(f"tensor fields disagree on the batch size: {sizes}")
            batch = TensorDict(tensors, batch_size=[next(iter(sizes.values()))])
        return cls(batch=batch, non_tensor_batch=dict(non_tensors or {}), meta_info=dict(meta_info or {}))

    # ------------------------------------------------------------------ basic access
    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        if self.non_tensor_batch:
            return len(next(iter(self.non_tensor_batch.values())))
        return 0

    @property
    def tensors(self) -> TensorDict:
        """``batch``, the tensor fields, for code that reads or sets them (each ``[B, ...]``).

        Raises:
            KeyError: the DataProto has no tensor fields (``batch`` is None), so any field read is missing.
        """
        if self.batch is None:
            raise KeyError(f"this DataProto has no tensor fields (non-tensor fields: {sorted(self.non_tensor_batch)})")
        return self.batch

    def _check_lengths(self) -> None:
        n = len(self)
        for k, v in self.non_tensor_batch.items():
            if v.ndim != 1 or len(v) != n:
                raise ValueError(f"non-tensor field {k!r} has {len(v)} rows but the batch has {n}")

    def keys(self) -> list[str]:
        """All field names: tensor fields first, then non-tensor fields."""
        return _tensor_keys(self.batch) + list(self.non_tensor_batch.keys())

    def __contains__(self, key: str) -> bool:
        return key in self.keys()

    def __getitem__(self, idx: Index) -> DataProto:
        """Rows by int (one-row DataProto), slice, index tensor/array/list or boolean mask."""
        if isinstance(idx, str):
            raise TypeError(f"DataProto rows are indexed by position; use dp.batch[{idx!r}] "
                            f"or dp.non_tensor_batch[{idx!r}] for a field")
        n = len(self)
        if isinstance(idx, (int, np.integer)):
            i = int(idx)
            if not -n <= i < n:
                raise IndexError(f"row {i} out of range for a DataProto of {n} rows")
            i %= n
            idx = slice(i, i + 1)
        if isinstance(idx, slice):
            batch = self.batch[idx] if self.batch is not None else None
            nt = {k: v[idx] for k, v in self.non_tensor_batch.items()}
            return DataProto(batch, nt, dict(self.meta_info))
        index = torch.as_tensor(np.asarray(idx) if not isinstance(idx, torch.Tensor) else idx)
        if index.dtype == torch.bool:
            if index.shape != (n,):
                raise IndexError(f"boolean mask of shape {list(index.shape)} for {n} rows")
            index = index.nonzero().flatten()
        elif index.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"cannot index rows with a tensor of dtype {index.dtype}")
        index = index.long()
        if index.numel() and (index.max() >= n or index.min() < -n):
            raise IndexError(f"row index out of range for a DataProto of {n} rows")
        batch = self.batch[index] if self.batch is not None else None
        np_index = index.numpy()
        nt = {k: v[np_index] for k, v in self.non_tensor_batch.items()}
        return DataProto(batch, nt, dict(self.meta_info))

    def _missing(self, keys: Iterable[str], available: Iterable[str], kind: str) -> None:
        missing = [k for k in keys if k not in set(available)]
        if missing:
            raise KeyError(f"unknown {kind} field(s) {missing}; available: {sorted(available)}")

    def select(self, batch_keys: Sequence[str] | None = None, non_tensor_keys: Sequence[str] | None = None,
               meta_info_keys: Sequence[str] | None = None, deepcopy: bool = False) -> DataProto:
        """A DataProto with only the named fields (None keeps all of that part).

        Raises:
            KeyError: a requested field does not exist (the available ones are listed).
        """
        batch = self.batch
        if batch_keys is not None:
            self._missing(batch_keys, _tensor_keys(batch), "tensor")
            batch = batch.select(*batch_keys) if batch is not None else None
        nt = self.non_tensor_batch
        if non_tensor_keys is not None:
            self._missing(non_tensor_keys, nt.keys(), "non-tensor")
            nt = {k: nt[k] for k in non_tensor_keys}
        meta = self.meta_info
        if meta_info_keys is not None:
            self._missing(meta_info_keys, meta.keys(), "meta_info")
            meta = {k: meta[k] for k in meta_info_keys}
        if batch is not None and len(batch.keys()) == 0 and nt:
            batch = None
        out = DataProto(batch, dict(nt), dict(meta))
        return copy.deepcopy(out) if deepcopy else out

    def pop(self, batch_keys: Sequence[str] = (), non_tensor_keys: Sequence[str] = (),
            meta_info_keys: Sequence[str] = ()) -> DataProto:
        """Remove the named fields from this DataProto and return them as a new one."""
        out = self.select(list(batch_keys), list(non_tensor_keys), list(meta_info_keys))
        if batch_keys and self.batch is not None:  # (select above refused keys of a missing batch)
            self.batch = self.batch.exclude(*batch_keys)
        for k in non_tensor_keys:
            del self.non_tensor_batch[k]
        for k in meta_info_keys:
            del self.meta_info[k]
        return out

    # ------------------------------------------------------------------ combination
    def union(self, other: DataProto) -> DataProto:
        """Merge ``other``'s fields into a new DataProto.

        A field present on both sides must hold equal values.

        Raises:
            ValueError: different row counts, or a shared field with different values (named).
        """
        if len(self) != len(other):
            raise ValueError(f"cannot union DataProtos of {len(self)} and {len(other)} rows")
        batch = self.batch
        if other.batch is not None:
            if batch is None:
                batch = other.batch
            else:
                batch = batch.clone(recurse=False)
                for k in other.batch.keys():
                    if k in batch.keys():
                        a, b = batch.get(k), other.batch.get(k)
                        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
                            raise ValueError(f"union conflict on tensor field {k!r}: both sides have it "
                                             f"with different values")
                    else:
                        batch.set(k, other.batch.get(k))
        nt = dict(self.non_tensor_batch)
        for k, v in other.non_tensor_batch.items():
            if k in nt:
                if not all(_values_equal(x, y) for x, y in zip(nt[k], v, strict=True)):
                    raise ValueError(f"union conflict on non-tensor field {k!r}: different values")
            else:
                nt[k] = v
        meta = dict(self.meta_info)
        for k, v in other.meta_info.items():
            if k in meta and not _values_equal(meta[k], v):
                raise ValueError(f"union conflict on meta_info[{k!r}]: {meta[k]!r} != {v!r}")
            meta[k] = v
        return DataProto(batch, nt, meta)

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` equal parts in row order.

        Raises:
            ValueError: ``len(self)`` is not divisible by ``chunks`` (use :meth:`pad_to_divisor`).
        """
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a positive int, got {chunks!r}")
        n = len(self)
        if n % chunks != 0:
            raise ValueError(f"cannot chunk {n} rows into {chunks} equal parts; "
                             f"pad first with pad_to_divisor({chunks})")
        size = n // chunks
        return [self[i * size:(i + 1) * size] for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive pieces of ``split_size`` rows (the last may be shorter)."""
        if split_size < 1:
            raise ValueError(f"split_size must be >= 1, got {split_size}")
        return [self[i:i + split_size] for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Concatenate rows; all pieces must have the same fields. meta_info of the first wins.

        Raises:
            ValueError: empty input, or pieces with different field names (the piece is named).
        """
        if not data:
            raise ValueError("DataProto.concat needs at least one DataProto")
        first_keys = set(data[0].keys())
        for i, d in enumerate(data[1:], start=1):
            if set(d.keys()) != first_keys:
                raise ValueError(f"DataProto.concat: piece {i} has fields {sorted(d.keys())}, "
                                 f"piece 0 has {sorted(first_keys)}")
        batch = None
        batches = [d.batch for d in data if d.batch is not None]
        if batches:  # equal field names: every piece has a batch, or none has
            batch = TensorDict.cat(batches, dim=0)
        nt = {k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in data[0].non_tensor_batch}
        return DataProto(batch, nt, dict(data[0].meta_info))

    def repeat(self, repeat_times: int, interleave: bool = True) -> DataProto:
        """Repeat every row ``repeat_times`` times.

        ``interleave=True`` gives ``a a b b``; ``False`` gives ``a b a b``.
        """
        if repeat_times < 1:
            raise ValueError(f"repeat_times must be >= 1, got {repeat_times}")
        if interleave:
            index = torch.arange(len(self)).repeat_interleave(repeat_times)
        else:
            index = torch.arange(len(self)).repeat(repeat_times)
        return self[index]

    # ------------------------------------------------------------------ padding
    def pad_to_divisor(self, divisor: int) -> tuple[DataProto, int]:
        """Append copies of leading rows so that ``len`` divides by ``divisor``.

        Padded rows copy real rows cyclically (valid inputs for any forward pass) and have
        :data:`LOSS_WEIGHT_KEYS` zeroed so they carry no loss weight.

        Returns:
            (padded DataProto, number of rows added).
        """
        if not isinstance(divisor, int) or divisor < 1:
            raise ValueError(f"divisor must be a positive int, got {divisor!r}")
        n = len(self)
        if n == 0:
            raise ValueError("cannot pad an empty DataProto")
        pad = (-n) % divisor
        if pad == 0:
            return self, 0
        extra = self[torch.arange(pad) % n]
        if extra.batch is not None:
            for k in LOSS_WEIGHT_KEYS:
                if k in extra.batch.keys():
                    extra.batch.set(k, torch.zeros_like(extra.batch.get(k)))
        return DataProto.concat([self, extra]), pad

    def unpad(self, pad_size: int) -> DataProto:
        """Remove the last ``pad_size`` rows added by :meth:`pad_to_divisor`."""
        if pad_size < 0 or pad_size > len(self):
            raise ValueError(f"pad_size {pad_size} out of range for {len(self)} rows")
        return self if pad_size == 0 else self[: len(self) - pad_size]

    # ------------------------------------------------------------------ transfer
    def __getstate__(self) -> dict[str, Any]:
        # Tensor fields travel as numpy arrays so that Ray's pickle-5 serialiser moves them as
        # out-of-band buffers (one memcpy into the object store, none per element).
        tensors: dict[str, tuple[np.ndarray, str | None]] | None = None
        if self.batch is not None:
            tensors = {}
            for k in _tensor_keys(self.batch):
                t = self.batch.get(k).detach().cpu().contiguous()
                if t.dtype == torch.bfloat16:
                    tensors[k] = (t.view(torch.int16).numpy(), "bfloat16")
                else:
                    tensors[k] = (t.numpy(), None)
        return {"tensors": tensors, "batch_size": len(self), "non_tensor_batch": self.non_tensor_batch,
                "meta_info": self.meta_info}

    def __setstate__(self, state: dict[str, Any]) -> None:
        batch = None
        if state["tensors"] is not None:
            fields = {}
            for k, (arr, special) in state["tensors"].items():
                # Ray hands out read-only zero-copy buffers; take ownership before torch writes.
                t = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
                fields[k] = t.view(torch.bfloat16) if special == "bfloat16" else t
            batch = TensorDict(fields, batch_size=[state["batch_size"]])
        self.batch = batch
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]

    def __repr__(self) -> str:
        tensors = {k: f"{tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
                   for k, v in (self.batch.items() if self.batch is not None else [])}
        return (f"DataProto(rows={len(self)}, tensors={tensors}, "
                f"non_tensors={list(self.non_tensor_batch)}, meta_info={list(self.meta_info)})")


__all__ = ["DataProto", "STANDARD_FIELDS", "LOSS_WEIGHT_KEYS"]
