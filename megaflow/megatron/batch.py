"""Validation and left alignment of verl-layout padded batches for Megatron (pure, no processes).

Input layout (same as verl; ``S = P + R``):

* ``input_ids``, ``attention_mask`` ``[batch, S]``: a left-padded prompt followed by a
  right-padded response; the real tokens of a row form one contiguous span.
* ``position_ids`` ``[batch, S]`` (optional): ``cumsum(attention_mask) - 1`` on real tokens.
* ``responses`` ``[batch, R]``: equal to ``input_ids[:, -R:]``.

Megatron's GPTModel applies RoPE at positions ``0..L-1`` of its input, ignoring
``position_ids``, so each row is moved to the left (real tokens first, padding after) and
the batch is trimmed to the longest row. With a causal mask, trailing padding can never be
attended to by a real token, so results do not depend on padding or on which rows share a
micro-batch. The log-prob of response token ``t`` comes from the logits at ``t - 1``;
:attr:`LeftAlignedBatch.response_index` holds, per response position, the aligned index of
those logits.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

REQUIRED_KEYS = ("input_ids", "attention_mask", "responses")
#: Fields with one entry per position of ``input_ids`` (``[batch, seq, ...]``), left-aligned with
#: the tokens: ``routed_experts`` ``[batch, seq, moe_layers, topk]``, entry ``t`` the expert ids
#: the rollout engine routed the token at position ``t`` to (any integer dtype; 0 on padding).
ROUTED_EXPERTS_KEY = "routed_experts"
#: The same layout for the experts the actor's own router chose at the old-log-prob forward
#: (``compute_log_prob``): ``old_routed_experts`` ``[batch, seq, moe_layers, topk]``, layer index =
#: global layer number - 1, ``-1`` outside each row's tokens. ``actor.router_replay=R2`` replays
#: it in every forward of the update; the ``moe/routing_agreement`` metric compares it with
#: ``routed_experts``.
OLD_ROUTED_EXPERTS_KEY = "old_routed_experts"
POSITION_FIELDS = (ROUTED_EXPERTS_KEY, OLD_ROUTED_EXPERTS_KEY)


@dataclasses.dataclass
class LeftAlignedBatch:
    """Padded rows in Megatron's left-aligned layout (see module docstring): each row's real
    tokens first, then zero padding to the longest row. Rows are not packed together; every
    sequence keeps its own row.

    Attributes:
        input_ids: ``[batch, L]`` real tokens first, then zeros; ``L`` = longest row.
        lengths: ``[batch]`` real tokens per row.
        response_index: ``[batch, R]`` aligned position of the logits that predict response
            token ``r`` (clamped into range where the response token is padding).
        response_valid: ``[batch, R]`` bool, True where the response token is real.
        fields: the other ``[batch, ...]`` tensors of the input (e.g. ``response_mask``,
            ``old_log_probs``, ``advantages``), row-aligned, for the loss callback.
        width_multiple: ``L`` is the longest row rounded up to a multiple of this
            (``left_align_batch``'s argument; :meth:`take` keeps the rule).
    """

    input_ids: torch.Tensor
    lengths: torch.Tensor
    response_index: torch.Tensor
    response_valid: torch.Tensor
    fields: dict[str, torch.Tensor]
    width_multiple: int = 1

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def rows(self, start: int, stop: int) -> LeftAlignedBatch:
        """Rows ``[start, stop)`` (views)."""
        return LeftAlignedBatch(self.input_ids[start:stop], self.lengths[start:stop],
                           self.response_index[start:stop], self.response_valid[start:stop],
                           {k: v[start:stop] for k, v in self.fields.items()}, self.width_multiple)

    def select(self, index: torch.Tensor, width: int) -> LeftAlignedBatch:
        """Rows ``index`` (int64 ``[k]``), cut to the first ``width`` positions.

        ``width`` must cover the selected rows' real tokens; response positions past it
        (response padding) are clamped into the cut like :func:`left_align_batch` does.
        """
        if int(self.lengths[index].max()) > width:
            raise ValueError(f"width {width} is shorter than the longest selected row "
                             f"({int(self.lengths[index].max())} tokens)")
        return LeftAlignedBatch(self.input_ids[index, :width], self.lengths[index],
                           self.response_index[index].clamp_max(width - 1), self.response_valid[index],
                           {k: _cut(v[index], width) if k in POSITION_FIELDS else v[index]
                            for k, v in self.fields.items()}, self.width_multiple)

    def widen(self, width: int) -> LeftAlignedBatch:
        """The same rows with trailing zero padding up to ``width`` positions (no-op when
        already that wide); causal attention keeps trailing padding from changing a row."""
        if width <= self.seq_len:
            return self
        pad = torch.zeros((self.num_rows, width - self.seq_len), dtype=self.input_ids.dtype)
        return LeftAlignedBatch(torch.cat([self.input_ids, pad], dim=1), self.lengths, self.response_index,
                                self.response_valid,
                                {k: _cut(v, width) if k in POSITION_FIELDS else v for k, v in self.fields.items()},
                                self.width_multiple)

    def take(self, index: torch.Tensor) -> LeftAlignedBatch:
        """Rows ``index`` (int64 ``[k]``) as :func:`left_align_batch` aligns them on their own:
        cut to their longest row rounded up to :attr:`width_multiple` (the same tensors,
        without validating and aligning the rows again)."""
        longest = int(self.lengths[index].max())
        return self.select(index, -(-longest // self.width_multiple) * self.width_multiple)

    def pad_rows(self, multiple: int, zero_keys: tuple[str, ...] = ()) -> tuple[LeftAlignedBatch, int]:
        """Append copies of row 0 until the row count divides ``multiple``.

        The copies' ``fields[k]`` for ``k`` in ``zero_keys`` (loss masks) are zeroed so they
        weigh nothing in a loss. Returns ``(padded batch, number of rows added)``.
        """
        num_pad = -self.num_rows % multiple
        if num_pad == 0:
            return self, 0

        def extend(t: torch.Tensor, zero: bool = False) -> torch.Tensor:
            extra = t[:1].expand(num_pad, *t.shape[1:])
            return torch.cat([t, torch.zeros_like(extra) if zero else extra])

        return LeftAlignedBatch(extend(self.input_ids), extend(self.lengths),
                           extend(self.response_index), extend(self.response_valid),
                           {k: extend(v, k in zero_keys) for k, v in self.fields.items()},
                           self.width_multiple), num_pad


def _check_shapes(batch: Mapping[str, torch.Tensor]) -> tuple[int, int, int]:
    missing = [k for k in REQUIRED_KEYS if k not in batch]
    if missing:
        raise ValueError(f"batch is missing {missing}; it has {sorted(batch)}")
    input_ids, mask, responses = (batch[k] for k in REQUIRED_KEYS)
    if input_ids.ndim != 2 or mask.shape != input_ids.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                         f"{tuple(mask.shape)} must both be [batch, seq]")
    num_rows, seq = input_ids.shape
    if responses.ndim != 2 or responses.shape[0] != num_rows or not 0 < responses.shape[1] < seq:
        raise ValueError(f"responses {tuple(responses.shape)} must be [batch={num_rows}, R] "
                         f"with 0 < R < seq={seq}")
    for key, value in batch.items():
        if torch.is_tensor(value) and (value.ndim == 0 or value.shape[0] != num_rows):
            raise ValueError(f"batch field {key!r} has shape {tuple(value.shape)}; expected "
                             f"a leading batch dimension of {num_rows}")
    return num_rows, seq, responses.shape[1]


def _check_mask(mask: torch.Tensor, first: torch.Tensor, lengths: torch.Tensor, prompt_len: int):
    if not torch.all((mask == 0) | (mask == 1)):
        raise ValueError("attention_mask must contain only 0 and 1")
    positions = torch.arange(mask.shape[1])
    span = (positions >= first[:, None]) & (positions < (first + lengths)[:, None])
    bad = (span != mask.bool()).any(dim=1).nonzero().flatten()
    if len(bad):
        raise ValueError(f"attention_mask rows {bad.tolist()[:8]} are not one contiguous span of "
                         f"real tokens (left-padded prompt + right-padded response expected)")
    no_prompt = (mask[:, prompt_len - 1] == 0).nonzero().flatten()
    if len(no_prompt):
        raise ValueError(f"rows {no_prompt.tolist()[:8]} have no prompt token at position "
                         f"{prompt_len - 1}; every row needs >= 1 real prompt token")


def _cut(field: torch.Tensor, width: int) -> torch.Tensor:
    """A position field's first ``width`` positions (zero-padded when it is shorter)."""
    if field.shape[1] >= width:
        return field[:, :width]
    pad = torch.zeros((field.shape[0], width - field.shape[1], *field.shape[2:]), dtype=field.dtype)
    return torch.cat([field, pad], dim=1)


def _align_positions(field: torch.Tensor, index: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """``field`` ``[batch, seq, ...]`` gathered at the aligned positions ``index`` ``[batch, width]``
    (0 outside each row's tokens ``inside``), as the tokens are."""
    rows, width, trailing = index.shape[0], index.shape[1], field.shape[2:]
    shape = (rows, width, *([1] * len(trailing)))
    gathered = field.cpu().gather(1, index.reshape(shape).expand(rows, width, *trailing))
    return torch.where(inside.reshape(shape), gathered, torch.zeros((), dtype=field.dtype))


def unalign_positions(aligned: torch.Tensor, attention_mask: torch.Tensor, fill: int) -> torch.Tensor:
    """The inverse of the left alignment for a position field: ``aligned`` ``[batch, width, ...]``
    (entry ``j`` of row ``i`` belongs to that row's ``j``-th real token) placed back at the
    token positions of the verl layout of ``attention_mask`` ``[batch, seq]`` (left-padded
    prompt, right-padded response); ``fill`` where a position holds no real token.

    Raises:
        ValueError: ``aligned`` is narrower than the longest row or has other rows.
    """
    mask = attention_mask.cpu().bool()
    lengths = mask.sum(dim=1)
    if aligned.shape[0] != mask.shape[0] or aligned.shape[1] < int(lengths.max()):
        raise ValueError(f"aligned field {tuple(aligned.shape)} does not cover the rows of attention_mask "
                         f"{tuple(mask.shape)} (longest row {int(lengths.max())} tokens)")
    out = torch.full((*mask.shape, *aligned.shape[2:]), fill, dtype=aligned.dtype)
    rank = mask.long().cumsum(dim=1) - 1  # position p of a real token is the row's rank[p]-th token
    out[mask] = aligned[mask.nonzero()[:, 0], rank[mask]]
    return out


def left_align_batch(batch: Mapping[str, torch.Tensor], *, max_seq_len: int,
               vocab_size: int | None = None, width_multiple: int = 1) -> LeftAlignedBatch:
    """Validate a verl-layout batch (module docstring) and left-align it for Megatron.

    Args:
        batch: ``input_ids``, ``attention_mask``, ``responses`` (+ optional ``position_ids``
            and any row-aligned fields, passed through in :attr:`LeftAlignedBatch.fields`).
        max_seq_len: the longest allowed sequence (real tokens per row).
        vocab_size: when given, real token ids must lie in ``[0, vocab_size)``.
        width_multiple: the aligned width (longest sequence) is rounded up to a multiple of
            this with trailing padding (sequence parallelism splits positions over TP ranks);
            causal attention keeps padding after a sequence from changing it.

    Raises:
        ValueError: missing keys or wrong shapes (naming the field), a non-contiguous mask,
            a row without a prompt token, a sequence longer than ``max_seq_len``, token
            ids out of range, ``responses`` not equal to the end of ``input_ids``, or
            ``position_ids`` other than ``cumsum(attention_mask) - 1``.
    """
    num_rows, seq, resp_len = _check_shapes(batch)
    input_ids = batch["input_ids"].cpu().long()
    mask = batch["attention_mask"].cpu().long()
    lengths = mask.sum(dim=1)
    first = (mask.cumsum(dim=1) == 0).sum(dim=1)  # number of left-padding tokens
    _check_mask(mask, first, lengths, seq - resp_len)
    too_long = (lengths > max_seq_len).nonzero().flatten()
    if len(too_long):
        row = int(too_long[0])
        raise ValueError(f"sequence {row} has {int(lengths[row])} tokens, longer than the "
                         f"configured maximum max_seq_len={max_seq_len}")
    real = mask.bool()
    if vocab_size is not None and torch.any(real & ((input_ids < 0) | (input_ids >= vocab_size))):
        raise ValueError(f"input_ids contain token ids outside [0, {vocab_size})")
    resp_real = real[:, seq - resp_len:]
    if torch.any(resp_real & (batch["responses"].cpu().long() != input_ids[:, seq - resp_len:])):
        raise ValueError(f"responses must equal input_ids[:, -{resp_len}:] on real tokens")
    if "position_ids" in batch:
        expected = mask.cumsum(dim=1) - 1
        if torch.any(real & (batch["position_ids"].cpu().long() != expected)):
            raise ValueError("position_ids must be cumsum(attention_mask) - 1 on real tokens "
                             "(Megatron's RoPE uses positions 0..len-1 of each sequence)")
    width = -(-int(lengths.max()) // width_multiple) * width_multiple
    index = (first[:, None] + torch.arange(width)).clamp_max(seq - 1)
    inside = torch.arange(width) < lengths[:, None]
    aligned = torch.where(inside, input_ids.gather(1, index), torch.zeros_like(index))
    response_index = (seq - resp_len - 1 + torch.arange(resp_len)) - first[:, None]
    response_index = response_index.clamp(0, width - 1)
    skip = set(REQUIRED_KEYS) | {"position_ids"}
    fields = {k: v for k, v in batch.items() if k not in skip and torch.is_tensor(v)}
    for name in POSITION_FIELDS:
        if name in fields:
            if fields[name].shape[:2] != input_ids.shape:
                raise ValueError(f"{name} must be [batch, seq, ...] = {tuple(input_ids.shape)} in its first two "
                                 f"dimensions (one entry per position of input_ids), got {tuple(fields[name].shape)}")
            fields[name] = _align_positions(fields[name], index, inside)
    return LeftAlignedBatch(aligned, lengths, response_index, resp_real, fields, width_multiple)


def token_budget_groups(lengths: torch.Tensor, max_tokens: int, *, width_multiple: int = 1
                        ) -> list[tuple[torch.Tensor, int]]:
    """Group rows into micro-batches of at most ``max_tokens`` padded tokens.

    Rows are taken longest first (stable for equal lengths); a micro-batch grows while
    ``rows x width <= max_tokens``, where ``width`` is its longest row rounded up to
    ``width_multiple``. Sorting by length keeps the padding inside a micro-batch small
    (first-fit decreasing on one dimension).

    Args:
        lengths: ``[rows]`` real tokens per row.
        max_tokens: the budget (padded tokens per micro-batch).
        width_multiple: the aligned width's multiple (TP size with sequence parallelism).

    Returns:
        ``[(row index int64 [k], width)]`` covering every row exactly once, in order of
        decreasing width.

    Raises:
        ValueError: a row longer than the budget.
    """
    order = torch.sort(lengths, descending=True, stable=True).indices
    groups: list[tuple[torch.Tensor, int]] = []
    start = 0
    while start < len(order):
        width = -(-int(lengths[order[start]]) // width_multiple) * width_multiple
        if width > max_tokens:
            raise ValueError(f"a {int(lengths[order[start]])}-token sequence does not fit a micro-batch "
                             f"budget of {max_tokens} tokens")
        count = max(1, min(len(order) - start, max_tokens // width))
        groups.append((order[start:start + count], width))
        start += count
    return groups


__all__ = ["LeftAlignedBatch", "left_align_batch", "token_budget_groups", "REQUIRED_KEYS"]
