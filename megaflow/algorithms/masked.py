"""Masked reductions over ``[batch, response_len]`` tensors.

Conventions shared by every function here:

* ``mask`` has the shape of ``values`` and any dtype (bool, int, float); an entry is
  *valid* when it is non-zero. Values at invalid positions are never read: they may
  hold NaN or inf (padding after EOS often does) without affecting the result.
* Degenerate masks are defined, never an exception or NaN:

  ======================  =========  ===========================  ====================
  valid entries           sum        mean                         variance
  ======================  =========  ===========================  ====================
  0                       0          0                            0
  1                       the value  the value                    0
  >= 2                    usual      usual                        usual (Bessel if
                                                                  ``unbiased``)
  ======================  =========  ===========================  ====================

  :func:`masked_whiten` follows from those: with fewer than two valid entries the
  standard deviation is taken as 1 (nothing to scale by), so the centred output is 0.
"""
from __future__ import annotations

import torch

from megaflow.algorithms._checks import check_same_shape, check_tensor


def _zero_invalid(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    check_tensor("values", values)
    check_same_shape("values", values, mask=mask)
    return torch.where(mask.to(values.device) != 0, values, torch.zeros_like(values))


def _count(mask: torch.Tensor, dim: int | None, like: torch.Tensor) -> torch.Tensor:
    valid = (mask != 0).to(device=like.device, dtype=like.dtype)
    return valid.sum() if dim is None else valid.sum(dim)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` over valid entries.

    Args:
        values: ``[batch, response_len]`` (any shape) floating tensor.
        mask: same shape; non-zero = valid.
        dim: reduce over this dimension, or over everything when None.

    Returns:
        A 0-d tensor (``dim=None``) or ``values`` reduced over ``dim``; 0 where no entry
        is valid.

    Raises:
        TypeError / ValueError: non-tensor input or mismatched shapes.
    """
    masked = _zero_invalid(values, mask)
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over valid entries: ``sum(values * mask) / max(sum(mask), 1)``.

    Args:
        values: ``[batch, response_len]`` (any shape) floating tensor.
        mask: same shape; non-zero = valid.
        dim: reduce over this dimension (e.g. ``-1`` for a per-sequence mean ``[batch]``),
            or over everything when None.

    Returns:
        The mean; 0 for a reduction with no valid entry (documented, not NaN).
    """
    total = masked_sum(values, mask, dim)
    return total / _count(mask, dim, total).clamp_min(1)


def masked_var(
    values: torch.Tensor, mask: torch.Tensor, dim: int | None = None, *, unbiased: bool = True
) -> torch.Tensor:
    """Variance of ``values`` over valid entries (two-pass, numerically stable).

    ``var = sum(mask * (values - mean)^2) / (n - 1)`` with Bessel's correction when
    ``unbiased`` (``/ n`` otherwise), where ``n`` is the number of valid entries.

    Returns:
        The variance; 0 when ``n == 0`` or (``unbiased`` and ``n == 1``).
    """
    mean = masked_mean(values, mask, dim)
    centred = values - (mean if dim is None else mean.unsqueeze(dim))
    squares = masked_sum(centred * centred, mask, dim)
    count = _count(mask, dim, squares)
    dof = count - 1 if unbiased else count
    return torch.where(dof > 0, squares / dof.clamp_min(1), torch.zeros_like(squares))


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, epsilon: float = 1e-8
) -> torch.Tensor:
    """Normalise valid entries of ``values`` to zero mean and unit variance, jointly.

    ``out = (values - mean) / sqrt(var + epsilon)`` over all valid entries of the whole
    tensor (unbiased variance), or ``values / sqrt(var + epsilon)`` when ``shift_mean``
    is False. Used for batch-level advantage normalisation (PPO, REINFORCE++).

    Args:
        values: ``[batch, response_len]`` floating tensor.
        mask: same shape; non-zero = valid.
        shift_mean: subtract the mean (True) or only rescale (False).
        epsilon: added to the variance before the square root.

    Returns:
        Tensor shaped like ``values``, 0 at invalid entries. With fewer than two valid
        entries the scale is 1 (so the centred output is all 0).
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    num_valid = _count(mask, None, var)
    scale = torch.where(num_valid >= 2, torch.rsqrt(var + epsilon), torch.ones_like(var))
    out = (values - mean) * scale if shift_mean else values * scale
    return _zero_invalid(out, mask)
