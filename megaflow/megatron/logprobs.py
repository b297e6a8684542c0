"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary,
``[..., padded_vocab / tp]``. The softmax normaliser is assembled with two all-reduces over
the TP group passed in (MAX of the row maxima; SUM of ``[sum exp, target logit, sum p*z]``),
mirroring megatron-core's ``tensor_parallel.VocabParallelCrossEntropy`` but with an explicit
group and with entropy, whose value and gradient need the same global normaliser.

Formulas (``z`` logits divided by the temperature, ``p = softmax(z)`` over the real vocab):

* ``log p(y) = z_y - logsumexp(z)``; ``d/dz_i = 1[i = y] - p_i``.
* ``H = logsumexp(z) - sum_i p_i z_i``; ``dH/dz_i = p_i (E_p[z] - z_i) = -p_i (H + log p_i)``.

Vocabulary padding (rows ``>= vocab_size``, added for TP divisibility) is masked out of the
softmax, so the result equals a softmax over the true vocabulary at any TP size: no log(tp)
offset and no mass on padding (the pitfall of mixing vocab-parallel losses with gathered
logits does not arise because nothing is gathered).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _tp_size_rank(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_reduce(tensor: torch.Tensor, op, group, tp_size: int) -> torch.Tensor:
    if tp_size > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """Autograd function: (z [N, V/tp] fp32, target [N]) -> (log_probs [N], entropy [N])."""

    @staticmethod
    def forward(ctx, z, target, group, tp_size, vocab_start):
        ctx.set_materialize_grads(False)  # an unused output (entropy) gets no gradient work
        z_max = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group, tp_size)
        exp_z = torch.exp(z - z_max.unsqueeze(-1))
        local_target = target - vocab_start
        in_shard = (local_target >= 0) & (local_target < z.shape[-1])
        safe_target = torch.where(in_shard, local_target, torch.zeros_like(local_target))
        target_z = z.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
        target_z = torch.where(in_shard, target_z, torch.zeros_like(target_z))
        stats = torch.stack([exp_z.sum(-1), target_z, (exp_z * z).sum(-1)])  # [3, N]
        _all_reduce(stats, dist.ReduceOp.SUM, group, tp_size)
        sum_exp, target_z, sum_exp_z = stats
        log_normaliser = z_max + torch.log(sum_exp)
        log_probs = target_z - log_normaliser
        entropy = log_normaliser - sum_exp_z / sum_exp
        probs = exp_z.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(probs, safe_target, in_shard, entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        probs, safe_target, in_shard, entropy = ctx.saved_tensors
        grad_z = torch.zeros_like(probs)
        if grad_log_probs is not None:
            grad_z -= probs * grad_log_probs.unsqueeze(-1)
            hit = (grad_log_probs * in_shard.to(grad_log_probs.dtype)).unsqueeze(-1)
            grad_z.scatter_add_(-1, safe_target.unsqueeze(-1), hit)
        if grad_entropy is not None:
            # dH/dz_i = -(p_i * H + p_i log p_i); xlogy keeps masked (p = 0) entries at 0.
            grad_z -= (probs * entropy.unsqueeze(-1) + torch.xlogy(probs, probs)) * grad_entropy.unsqueeze(-1)
        return grad_z, None, None, None, None


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, *,
                             tp_group: Optional[dist.ProcessGroup], vocab_size: Optional[int] = None,
                             temperature: float = 1.0, with_entropy: bool = False
                             ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of ``labels`` (and the entropy) under ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., padded_vocab / tp]`` this TP rank's contiguous vocab shard (rank r
            holds ids ``[r * V_local, (r + 1) * V_local)``); any float dtype, computed in fp32.
        labels: ``[...]`` int64 token ids in ``[0, vocab_size)``.
        tp_group: the tensor-parallel group (None = no tensor parallelism).
        vocab_size: the real vocabulary size; ids ``>= vocab_size`` (padding) get zero
            probability. None = no padding.
        temperature: the sampling temperature the rollout applied (``logits / temperature``).
        with_entropy: also return the entropy ``[...]`` (nats) of the tempered distribution.

    Returns:
        ``(log_probs [...], entropy [...] or None)``, float32, differentiable w.r.t. logits.

    Raises:
        ValueError: non-positive temperature or mismatched leading shapes.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} "
                         f"disagree on the leading dimensions")
    tp_size, tp_rank = _tp_size_rank(tp_group)
    local_vocab = logits.shape[-1]
    vocab_start = tp_rank * local_vocab
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    if vocab_size is not None and vocab_start + local_vocab > vocab_size:
        padding = torch.arange(vocab_start, vocab_start + local_vocab, device=z.device) >= vocab_size
        z = z.masked_fill(padding, torch.finfo(z.dtype).min)
    lead = labels.shape
    log_probs, entropy = _VocabParallelLogProbEntropy.apply(
        z.reshape(-1, local_vocab), labels.reshape(-1), tp_group, tp_size, vocab_start)
    return log_probs.view(lead), (entropy.view(lead) if with_entropy else None)


def chunked_vocab_parallel_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                                     chunk_tokens: int, tp_group: Optional[dist.ProcessGroup],
                                     vocab_size: Optional[int] = None, temperature: float = 1.0,
                                     with_entropy: bool = False
                                     ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`vocab_parallel_log_probs` of ``hidden @ weight.T`` without ever holding the
    logits of more than ``chunk_tokens`` tokens.

    The output projection and the vocab-parallel softmax run chunk by chunk; with autograd
    on, each chunk is checkpointed (``torch.utils.checkpoint``, non-reentrant), so backward
    recomputes its ``[chunk_tokens, V/tp]`` logits instead of keeping them: the peak is one
    chunk's logits and probabilities, not ``[tokens, V/tp]`` (what makes a 128k-256k
    vocabulary affordable).

    Args:
        hidden: ``[..., h]`` final hidden states, already in the TP region (replicated over
            the TP ranks, its gradient all-reduced by the caller's region mapping).
        weight: ``[V/tp, h]`` this rank's vocabulary shard of the output projection.
        labels: ``[...]`` int64 token ids.
        chunk_tokens: tokens per chunk (> 0).
        tp_group, vocab_size, temperature, with_entropy: as :func:`vocab_parallel_log_probs`.

    Returns:
        ``(log_probs [...], entropy [...] or None)``, float32.

    Raises:
        ValueError: ``chunk_tokens < 1`` or shapes that disagree.
    """
    from torch.utils.checkpoint import checkpoint

    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.shape[:-1] != labels.shape or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and labels "
                         f"{tuple(labels.shape)} disagree")
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)

    def chunk(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs, entropy = vocab_parallel_log_probs(h @ w.t(), y, tp_group=tp_group, vocab_size=vocab_size,
                                                      temperature=temperature, with_entropy=True)
        return log_probs, entropy

    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    outputs = []
    for start in range(0, flat_labels.shape[0], chunk_tokens):
        args = (flat_hidden[start:start + chunk_tokens], weight, flat_labels[start:start + chunk_tokens])
        outputs.append(checkpoint(chunk, *args, use_reentrant=False) if grad else chunk(*args))
    if not outputs:
        empty = hidden.new_zeros(labels.shape, dtype=torch.float32)
        return empty, (empty.clone() if with_entropy else None)
    log_probs = torch.cat([o[0] for o in outputs]).view(labels.shape)
    entropy = torch.cat([o[1] for o in outputs]).view(labels.shape) if with_entropy else None
    return log_probs, entropy


__all__ = ["vocab_parallel_log_probs", "chunked_vocab_parallel_log_probs"]
