"""Deterministic, resumable prompt batches.

The order of epoch ``e`` is a function of ``(seed, e)`` only (``numpy``'s PCG64 seeded
with the sequence ``[seed, e]``), so it is the same on every machine and run. The
loader's state is ``(epoch, number of samples consumed in that epoch)``; restoring it
in a fresh process continues with exactly the batch that would have come next.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from megaflow.data.dataset import collate_fn as default_collate_fn
from megaflow.protocol import DataProto


def epoch_order(num_samples: int, *, epoch: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """Sample indices of one epoch: a seeded permutation, or ``arange`` without shuffle."""
    if not shuffle:
        return np.arange(num_samples)
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


class PromptDataLoader:
    """Batches of prompts as :class:`DataProto`, in a fixed order per ``(seed, epoch)``.

    ``iter(loader)`` yields the remaining batches of the current epoch; when it is
    exhausted the loader moves to the next epoch (a new permutation), so the next
    ``iter(loader)`` starts it. ``state_dict()`` taken between batches and restored with
    ``load_state_dict()`` (in any process) makes the next batch the same one an
    uninterrupted run would have produced.

    Args:
        dataset: a map-style dataset (``len`` and ``[i]``), e.g. :class:`RLHFDataset`.
        batch_size: prompts per batch.
        shuffle: permute each epoch (else dataset order).
        seed: permutation seed.
        drop_last: drop the last incomplete batch of an epoch (training wants equal
            batch sizes); False keeps it (validation).
        collate_fn: items -> DataProto.

    Raises:
        ValueError: ``batch_size < 1``, or ``drop_last`` with fewer samples than one batch.
    """

    def __init__(self, dataset: Any, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, collate_fn: Callable[[Sequence[Any]], DataProto] = default_collate_fn):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and len(dataset) < batch_size:
            raise ValueError(
                f"the dataset has {len(dataset)} prompts, fewer than one batch of {batch_size} "
                "(with drop_last=True no batch could be formed)"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        self.epoch = 0
        self.position = 0  # samples of the current epoch already yielded

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    @property
    def _epoch_end(self) -> int:
        return len(self) * self.batch_size if self.drop_last else len(self.dataset)

    def __iter__(self) -> Iterator[DataProto]:
        if self.position >= self._epoch_end:  # state saved right after an epoch's last batch
            self.epoch, self.position = self.epoch + 1, 0
        order = epoch_order(len(self.dataset), epoch=self.epoch, seed=self.seed, shuffle=self.shuffle)
        while self.position < self._epoch_end:
            indices = order[self.position: self.position + self.batch_size]
            self.position += len(indices)
            yield self.collate_fn([self.dataset[int(i)] for i in indices])
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position", "seed", "num_samples", "batch_size", "shuffle", "drop_last"}``."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_samples": len(self.dataset), "batch_size": self.batch_size,
                "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        Raises:
            ValueError: the state was saved with a different dataset size, batch size,
                seed, shuffle or drop_last (the order would not continue exactly); the
                differing keys are named.
        """
        mine = self.state_dict()
        missing = [k for k in mine if k not in state]
        if missing:
            raise ValueError(f"loader state is missing keys {missing}")
        differ = {k: (state[k], mine[k]) for k in ("seed", "num_samples", "batch_size", "shuffle", "drop_last")
                  if state[k] != mine[k]}
        if differ:
            detail = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in differ.items())
            raise ValueError(f"cannot resume the prompt loader exactly, its setup changed ({detail})")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
