"""Settings of :class:`megaflow.megatron.engine.MegatronEngine` and the loss denominators."""
from __future__ import annotations

import dataclasses
from typing import Optional

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


@dataclasses.dataclass(frozen=True)
class GlobalDenominators:
    """Counts over the whole mini-batch (all DP ranks and micro-batches) for loss aggregation.

    ``num_tokens``: valid tokens of the loss mask; ``num_seqs``: rows with >= 1 valid token
    (``megaflow.algorithms.aggregate_loss``'s ``global_num_tokens`` / ``global_num_seqs``).
    """

    num_tokens: int
    num_seqs: int


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Micro-batching, optimizer, LR schedule and offload settings of one role's engine.

    The optimizer is megatron-core's Adam (decoupled weight decay, not applied to biases
    and norms) with gradient clipping by global norm; the LR follows Megatron's
    ``OptimizerParamScheduler``: linear warm-up from ``lr_warmup_init`` to ``lr`` over
    ``lr_warmup_steps`` updates, then ``lr_decay_style`` towards ``min_lr`` until
    ``lr_decay_steps``. The k-th update uses the LR of step k, so with warm-up the first
    update uses ``lr_warmup_init + (lr - lr_warmup_init) / lr_warmup_steps``.
    """

    max_seq_len: int = 2048  # longest sequence (real tokens) accepted
    micro_batch_size: int = 4  # rows per micro-batch in train_step
    forward_micro_batch_size: int = 8  # rows per micro-batch in forward
    # Token-budget micro-batches (verl's dynamic batch size): when set, rows are grouped by length
    # into micro-batches of at most this many padded tokens (rows x the micro-batch's longest
    # sequence), replacing the fixed row counts above.
    max_tokens_per_micro_batch: Optional[int] = None  # train_step
    forward_max_tokens_per_micro_batch: Optional[int] = None  # forward
    # Actor: project onto the vocabulary and normalise this many response tokens at a time
    # (never [tokens, vocab] logits at once); None: the model's own output layer.
    logits_chunk_tokens: Optional[int] = None
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_init: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_steps: Optional[int] = None  # None: lr_warmup_steps + 1 (constant after warm-up)
    lr_decay_style: str = "constant"
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # max global grad norm; 0 disables clipping
    use_distributed_optimizer: Optional[bool] = None  # None: when dp > 1
    overlap_grad_reduce: bool = False
    check_for_nan_in_grad: bool = False
    loss_mask_keys: tuple[str, ...] = ("response_mask",)  # zeroed on padding rows; [0] counts

    def __post_init__(self) -> None:
        for name in ("max_seq_len", "micro_batch_size", "forward_micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.logits_chunk_tokens is not None and self.logits_chunk_tokens < 1:
            raise ValueError(f"EngineConfig.logits_chunk_tokens must be >= 1, got {self.logits_chunk_tokens}")
        for name in ("max_tokens_per_micro_batch", "forward_max_tokens_per_micro_batch"):
            budget = getattr(self, name)
            if budget is not None and budget < self.max_seq_len:
                raise ValueError(f"EngineConfig.{name}={budget} is below max_seq_len={self.max_seq_len}: "
                                 f"the longest sequence would not fit in one micro-batch")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"EngineConfig needs 0 <= min_lr <= lr, got min_lr={self.min_lr}, "
                             f"lr={self.lr}")
        if not 0 <= self.lr_warmup_init <= self.lr:
            raise ValueError(f"EngineConfig.lr_warmup_init must be in [0, lr], got "
                             f"{self.lr_warmup_init}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"EngineConfig.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.lr_warmup_steps:
            raise ValueError(f"EngineConfig.lr_decay_steps={self.lr_decay_steps} must exceed "
                             f"lr_warmup_steps={self.lr_warmup_steps}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"EngineConfig.lr_decay_style={self.lr_decay_style!r}; choose one of "
                             f"{LR_DECAY_STYLES}")
        if self.weight_decay < 0 or self.clip_grad < 0:
            raise ValueError("EngineConfig.weight_decay and clip_grad must be >= 0")
        if not self.loss_mask_keys:
            raise ValueError("EngineConfig.loss_mask_keys must name at least one field")

    def resolve_distributed_optimizer(self, dp_size: int) -> bool:
        """Use Megatron's distributed optimizer: as configured, else when ``dp_size > 1``."""
        if self.use_distributed_optimizer is None:
            return dp_size > 1
        return self.use_distributed_optimizer


__all__ = ["EngineConfig", "GlobalDenominators", "LR_DECAY_STYLES"]
