"""Loss aggregation over ``[batch, response_len]`` per-token losses, split-invariant.

A PPO mini-batch is cut into DP ranks x micro-batches. To make the optimiser step
independent of that cut, every micro-batch divides its partial sum by denominators of
the *whole* mini-batch (global denominators, across DP ranks and micro-batches):

    full_loss = sum over DP ranks r, micro-batches m of aggregate_loss(loss_mat[r, m], ...)

holds exactly (up to float rounding) for every mode, and so do the gradients.

Denominators (what the engine all-reduces over DP,
:meth:`megaflow.megatron.engine.MegatronEngine.global_denominators`):

* ``num_tokens``: the number of valid tokens (mask non-zero).
* ``num_seqs``: the number of sequences with **at least one** valid token. Fully masked
  rows (empty responses, rows padded in for divisibility) are not counted, so they
  contribute nothing to the numerator *nor* to the denominator: adding or removing them
  never changes the loss.

Modes (``L_{b,t}`` per-token loss, ``m_{b,t}`` mask, ``n_b = sum_t m_{b,t}``):

* ``"token-mean"``: ``sum_{b,t} m L / num_tokens`` (every token weighs the same; DAPO,
  Yu et al. 2025, "Token-Level Policy Gradient Loss").
* ``"seq-mean-token-sum"``: ``sum_b (sum_t m L) / num_seqs``.
* ``"seq-mean-token-mean"``: ``sum_b (sum_t m L / n_b) / num_seqs`` (the original GRPO
  objective, Shao et al. 2024, eq. 3; GSPO's default).
* ``"seq-mean-token-sum-norm"``: ``sum_b (sum_t m L) / (num_seqs * norm_length)``
  (Dr. GRPO, Liu et al. 2025: divide by a constant generation budget instead of the
  response length, removing the length bias). ``norm_length`` defaults to the padded
  ``response_len`` of the tensor; pass the configured maximum response length when
  micro-batches may be padded to different lengths.

Without global denominators the local counts of this call are used, which is the
correct value for an unsplit batch.

Note for the engine: the result of a micro-batch is a *partial sum*. Gradient
accumulation must add micro-batch gradients (not average them) and the DP gradient
reduction must sum. megatron-core (0.16) does neither by default: its schedule divides
a loss returned as ``(loss, reduced)`` by ``num_microbatches`` (and multiplies it by the
CP size), and its DDP averages gradients over DP. So a loss callback multiplies the
result by ``num_microbatches * dp_size`` (or the equivalent configuration) before
handing it to Megatron.
"""
from __future__ import annotations

import torch

from megaflow.algorithms._checks import check_choice, check_same_shape, check_tensor

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

Count = int | float | torch.Tensor


def _denominator(name: str, value: Count | None, local: torch.Tensor) -> torch.Tensor:
    if value is None:
        return local.clamp_min(1)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        value = value.reshape(()).to(device=local.device, dtype=local.dtype)
        if bool(value < 0):
            raise ValueError(f"{name} must be >= 0, got {value.item()}")
        return value.clamp_min(1)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{name} must be a non-negative number or a scalar tensor, got {value!r}")
    return torch.tensor(max(float(value), 1.0), dtype=local.dtype, device=local.device)


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    norm_length: int | float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[batch, response_len]`` to a scalar (see module docs).

    Args:
        loss_mat: ``[batch, response_len]`` per-token loss (values at masked positions are
            ignored, even NaN/inf).
        mask: same shape; non-zero = valid token.
        mode: one of :data:`LOSS_AGG_MODES`.
        global_num_tokens: valid tokens in the whole mini-batch (all DP ranks and
            micro-batches); used by ``"token-mean"``. None = this call's count.
        global_num_seqs: sequences with >= 1 valid token in the whole mini-batch; used by
            the ``seq-mean-*`` modes. None = this call's count.
        norm_length: the constant of ``"seq-mean-token-sum-norm"`` (default
            ``response_len``); ignored by other modes.

    Returns:
        0-d tensor: this call's share of the mini-batch loss (the full value when no
        global denominators are given). Zero when there is no valid token. Computed in
        float32 or wider.

    Raises:
        ValueError: unknown ``mode`` (lists the valid ones), shape mismatch, negative or
            non-scalar denominators, non-positive ``norm_length``.
    """
    check_choice("loss_agg_mode", mode, LOSS_AGG_MODES)
    check_tensor("loss_mat", loss_mat, ndim=2)
    check_same_shape("loss_mat", loss_mat, mask=mask)
    if loss_mat.dtype in (torch.float16, torch.bfloat16):
        loss_mat = loss_mat.float()
    valid = mask.to(loss_mat.device) != 0
    masked = torch.where(valid, loss_mat, torch.zeros_like(loss_mat))
    counts = valid.to(loss_mat.dtype)

    if mode == "token-mean":
        return masked.sum() / _denominator("global_num_tokens", global_num_tokens, counts.sum())

    seq_sums = masked.sum(dim=-1)
    num_seqs = _denominator("global_num_seqs", global_num_seqs, valid.any(dim=-1).to(loss_mat.dtype).sum())
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / num_seqs
    if mode == "seq-mean-token-mean":
        return (seq_sums / counts.sum(dim=-1).clamp_min(1)).sum() / num_seqs
    length = max(loss_mat.shape[-1], 1) if norm_length is None else norm_length
    if isinstance(length, bool) or not isinstance(length, (int, float)) or length <= 0:
        raise ValueError(f"norm_length must be a positive number, got {norm_length!r}")
    return seq_sums.sum() / (num_seqs * float(length))
