"""Argument checks shared by the algorithm functions (private).

Every public function in :mod:`megaflow.algorithms` validates its tensors with these
helpers so that a bad call fails with a message that names the offending argument
and shape instead of a broadcasting error deep inside the math.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


def check_tensor(name: str, value: object, *, ndim: int | None = None) -> torch.Tensor:
    """Return ``value`` if it is a tensor with ``ndim`` dims, else raise TypeError/ValueError."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(
            f"{name} must have {ndim} dimension(s) ([batch, response_len] for 2), "
            f"got shape {tuple(value.shape)}"
        )
    return value


def check_same_shape(reference_name: str, reference: torch.Tensor, **others: torch.Tensor) -> None:
    """Raise ValueError naming the first tensor in ``others`` whose shape differs."""
    for name, tensor in others.items():
        check_tensor(name, tensor)
        if tensor.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but {reference_name} has shape "
                f"{tuple(reference.shape)}; they must match"
            )


def check_choice(kind: str, value: str, choices: Iterable[str]) -> str:
    """Raise ValueError listing the valid choices when ``value`` is not one of them."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"unknown {kind} {value!r}; valid choices: {', '.join(choices)}")
    return value

