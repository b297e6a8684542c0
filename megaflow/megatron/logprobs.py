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

Truncated sampling (``top_k`` / ``top_p``): the log-probs and entropy are those of the
distribution vLLM samples from, ``softmax`` over the tokens its top-k/top-p filter keeps
(:func:`truncation_mask`, vLLM 0.32 ``v1/sample/ops/topk_topp_sampler.py``,
``apply_top_k_top_p_pytorch``), so they equal its ``processed_logprobs``. A token outside the
kept set has probability 0; its log-prob is reported as :data:`OUTSIDE_SUPPORT_LOG_PROB`
(``log`` of the smallest normal float32, about -87.34 nats) rather than ``-inf``, so ratios,
KL estimators and metrics stay finite (e.g. a reference policy whose own nucleus excludes
the sampled token).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def _tp_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_reduce(tensor: torch.Tensor, op, group, tp_size: int) -> torch.Tensor:
    if tp_size > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


#: Log-prob reported for a token outside the top-k/top-p kept set (probability 0):
#: ``log`` of float32's smallest normal number, about -87.34 nats.
OUTSIDE_SUPPORT_LOG_PROB = math.log(torch.finfo(torch.float32).tiny)


def truncation_active(top_p: float, top_k: int) -> bool:
    """True when top-p (``top_p < 1``) or top-k (``top_k > 0``) sampling is on."""
    return top_p < 1.0 or top_k > 0


def _all_gather_columns(x: torch.Tensor, group, tp_size: int) -> torch.Tensor:
    """``[N, c]`` on each TP rank -> ``[N, tp * c]`` (the ranks' columns side by side)."""
    if tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _top_k_threshold(z: torch.Tensor, top_k: int, group, tp_size: int) -> torch.Tensor:
    """``[N]`` the global k-th largest value of each row of the vocab-sharded ``z [N, V/tp]``."""
    local = z.topk(min(top_k, z.shape[-1]), dim=-1).values
    return _all_gather_columns(local, group, tp_size).topk(top_k, dim=-1).values[:, -1]


def _top_p_threshold(z: torch.Tensor, top_p: float, group, tp_size: int) -> torch.Tensor:
    """``[N]`` the smallest kept value of each row's nucleus (vocab-sharded ``z [N, V/tp]``).

    A token is kept iff the probability mass of the tokens strictly above it is ``< top_p``.
    Only each rank's local candidates (local mass above ``< top_p``, a prefix of its sorted
    shard containing every token the global rule keeps) are gathered, padded to the longest.
    """
    z_max = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group, tp_size)
    exp_z = torch.exp(z - z_max.unsqueeze(-1))
    total = _all_reduce(exp_z.sum(-1), dist.ReduceOp.SUM, group, tp_size)
    values, order = z.sort(dim=-1, descending=True)
    probs = exp_z.gather(-1, order) / total.unsqueeze(-1)
    above = torch.cumsum(probs, dim=-1) - probs  # local mass strictly above each token
    local_count = (above < top_p).sum(-1).max().reshape(1)
    count = int(_all_reduce(local_count, dist.ReduceOp.MAX, group, tp_size))
    values = _all_gather_columns(values[:, :count], group, tp_size)
    probs = _all_gather_columns(probs[:, :count], group, tp_size)
    values, order = values.sort(dim=-1, descending=True)
    probs = probs.gather(-1, order)
    kept = (torch.cumsum(probs, dim=-1) - probs) < top_p
    return torch.where(kept, values, torch.full_like(values, float("inf"))).min(dim=-1).values


@torch.no_grad()
def truncation_mask(z: torch.Tensor, *, top_p: float = 1.0, top_k: int = -1,
                    tp_group: dist.ProcessGroup | None = None,
                    vocab_size: int | None = None) -> torch.Tensor:
    """The tokens vLLM's top-k/top-p filter removes, vocabulary-parallel over TP.

    Semantics of vLLM 0.32 (``apply_top_k_top_p_pytorch`` and ``apply_top_k_only`` in
    ``vllm/v1/sample/ops/topk_topp_sampler.py``; ``Sampler.sample`` applies the temperature
    first, so ``z`` is ``logits / temperature``):

    1. top-k first: every token whose value is below the k-th largest is removed; ties with
       the k-th value are all kept (possibly more than k tokens). ``top_k >= vocab_size``
       keeps everything.
    2. then top-p on the survivors, renormalised (``softmax`` over the top-k set): sorted
       ascending, a token is removed while the cumulative mass up to and including it is
       ``<= 1 - top_p``; the largest token is always kept. Equivalently (what is computed
       here, in float32): a token is kept iff the mass strictly above it is ``< top_p``.
       Tokens tied at the nucleus boundary are all kept here (vLLM's unstable sort may cut
       such a tie group anywhere), and a token whose boundary mass lies within float32
       rounding of ``top_p`` (about 1e-7) may be classified differently.

    Each rank exchanges only its local top-k values and its local top-p candidates (at most
    its shard), never the whole vocabulary.

    Args:
        z: ``[N, V/tp]`` float32 tempered logits, this TP rank's contiguous vocab shard,
            padding (ids ``>= vocab_size``) already at ``finfo.min``.
        top_p: nucleus mass in ``(0, 1]`` (1 = off).
        top_k: tokens kept by top-k (``<= 0`` = off).
        tp_group: the tensor-parallel group (None = no tensor parallelism).
        vocab_size: the real vocabulary size (caps ``top_k``); None = ``z``'s full width x tp.

    Returns:
        ``[N, V/tp]`` bool, True for removed tokens (padding included only if already masked
        below every kept value).

    Raises:
        ValueError: ``top_p`` outside ``(0, 1]``.
    """
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    tp_size, _ = _tp_size_rank(tp_group)
    vocab = vocab_size if vocab_size is not None else z.shape[-1] * tp_size
    removed = torch.zeros_like(z, dtype=torch.bool)
    if z.shape[0] == 0:
        return removed
    if 0 < top_k < vocab:
        removed |= z < _top_k_threshold(z, top_k, tp_group, tp_size).unsqueeze(-1)
    if top_p < 1.0:
        kept_z = z.masked_fill(removed, torch.finfo(z.dtype).min)
        removed |= z < _top_p_threshold(kept_z, top_p, tp_group, tp_size).unsqueeze(-1)
    return removed


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
                             tp_group: dist.ProcessGroup | None, vocab_size: int | None = None,
                             temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                             with_entropy: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` (and the entropy) under ``softmax(logits / temperature)``,
    truncated to the tokens top-k/top-p keep when either is on (:func:`truncation_mask`).

    Args:
        logits: ``[..., padded_vocab / tp]`` this TP rank's contiguous vocab shard (rank r
            holds ids ``[r * V_local, (r + 1) * V_local)``); any float dtype, computed in fp32.
        labels: ``[...]`` int64 token ids in ``[0, vocab_size)``.
        tp_group: the tensor-parallel group (None = no tensor parallelism).
        vocab_size: the real vocabulary size; ids ``>= vocab_size`` (padding) get zero
            probability. None = no padding.
        temperature: the sampling temperature the rollout applied (``logits / temperature``).
        top_p, top_k: the rollout's nucleus mass (1 = off) and top-k (``<= 0`` = off): the
            distribution is renormalised over the kept tokens (vLLM's processed log-probs);
            a label outside them gets :data:`OUTSIDE_SUPPORT_LOG_PROB` (no gradient). The
            kept set is a function of the logits' values only (no gradient through it).
        with_entropy: also return the entropy ``[...]`` (nats) of the tempered (and
            truncated, when top-k/top-p are on) distribution.

    Returns:
        ``(log_probs [...], entropy [...] or None)``, float32, differentiable w.r.t. logits.

    Raises:
        ValueError: non-positive temperature, ``top_p`` outside ``(0, 1]`` or mismatched
            leading shapes.
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
    z = z.reshape(-1, local_vocab)
    truncated = truncation_active(top_p, top_k)
    if truncated:
        removed = truncation_mask(z.detach(), top_p=top_p, top_k=top_k, tp_group=tp_group, vocab_size=vocab_size)
        z = z.masked_fill(removed, torch.finfo(z.dtype).min)
    log_probs, entropy = _VocabParallelLogProbEntropy.apply(z, labels.reshape(-1), tp_group, tp_size, vocab_start)
    if truncated:
        log_probs = log_probs.clamp_min(OUTSIDE_SUPPORT_LOG_PROB)
    return log_probs.view(lead), (entropy.view(lead) if with_entropy else None)


def chunked_vocab_parallel_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                                     chunk_tokens: int, tp_group: dist.ProcessGroup | None,
                                     vocab_size: int | None = None, temperature: float = 1.0,
                                     top_p: float = 1.0, top_k: int = -1, with_entropy: bool = False
                                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        tp_group, vocab_size, temperature, top_p, top_k, with_entropy: as
            :func:`vocab_parallel_log_probs`.

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
                                                      temperature=temperature, top_p=top_p, top_k=top_k,
                                                      with_entropy=True)
        assert entropy is not None  # (with_entropy=True)
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


__all__ = ["vocab_parallel_log_probs", "chunked_vocab_parallel_log_probs", "truncation_mask", "truncation_active",
           "OUTSIDE_SUPPORT_LOG_PROB"]
