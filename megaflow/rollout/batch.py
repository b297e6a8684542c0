"""Plain-tensor plumbing shared by the rollout engines: prompts in, verl-style fields out.

Input: ``input_ids`` ``[batch, prompt_len]`` left-padded and its ``attention_mask``.
Output (``batch * n`` rows, the ``n`` samples of a prompt adjacent, as
``DataProto.repeat(n, interleave=True)`` orders them)::

    prompts            [batch*n, prompt_len]               int64, left-padded (as given)
    responses          [batch*n, response_len]             int64, right-padded with pad id
    input_ids          [batch*n, prompt_len+response_len]  prompts then responses
    attention_mask     [batch*n, prompt_len+response_len]  prompt mask then response_mask
    position_ids       [batch*n, prompt_len+response_len]  see position_ids_for_rollout
    response_mask      [batch*n, response_len]             1 on the generated tokens
    rollout_log_probs  [batch*n, response_len]             float32, 0 where masked

The response mask is built from each response's *length* (the engine's count of
generated tokens, which includes the EOS that stopped it), i.e. by position, never by
comparing ids with the pad id (pad == eos for many tokenizers).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from megaflow.protocol import DataProto


def check_left_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Check that prompts are left-padded; returns each prompt's real tokens ``[batch]`` (int64).

    Args:
        input_ids: ``[batch, prompt_len]`` integer ids.
        attention_mask: ``[batch, prompt_len]``, 1 on real tokens; every row must be
            left-padded (zeros, then ones) and hold at least one real token.

    Raises:
        TypeError: non-integer ``input_ids``.
        ValueError: shapes differ, not 2-D, a row with no real token, or a row that is not
            left-padded (a 0 after a 1); the row index is named.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"'input_ids' must be a [batch, prompt_len] tensor, got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise TypeError(f"'input_ids' must hold integer token ids, got dtype {input_ids.dtype}")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(f"'attention_mask' must have the shape of 'input_ids' {tuple(input_ids.shape)}, "
                         f"got {getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
    mask = attention_mask.to(torch.bool)
    lengths = mask.sum(dim=-1)
    empty = (lengths == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"prompt rows {empty[:8]} have no real token (attention_mask all zero)")
    left_padded = (mask.to(torch.int8).diff(dim=-1) >= 0).all(dim=-1)
    bad = (~left_padded).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"prompt rows {bad[:8]} are not left-padded: 'attention_mask' must be zeros "
                         f"then ones in every row")
    return lengths


def prompt_token_lists(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """The unpadded token ids of each left-padded prompt (``batch`` lists of ints), what
    the engine takes as requests.

    Raises:
        TypeError / ValueError: as :func:`check_left_padded`.
    """
    lengths = check_left_padded(input_ids, attention_mask)
    prompt_len = input_ids.shape[1]
    return [row[prompt_len - n:] for row, n in zip(input_ids.tolist(), lengths.tolist(), strict=True)]


def position_ids_for_rollout(prompt_mask: torch.Tensor, response_len: int) -> torch.Tensor:
    """Position ids of prompt + response, ``[batch, prompt_len + response_len]`` int64.

    Prompt part: ``clamp(cumsum(mask) - 1, min=0)`` (left padding gets 0); response part:
    continues from the last prompt position (``+1, +2, ...``) whether or not the token is
    padding, as verl does; only positions of real tokens matter to the model.
    """
    prompt_pos = (prompt_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
    delta = torch.arange(1, response_len + 1, dtype=torch.long, device=prompt_mask.device)
    return torch.cat([prompt_pos, prompt_pos[:, -1:] + delta], dim=-1)


def assemble_rollout_batch(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_token_ids: Sequence[Sequence[int]],
    response_log_probs: Sequence[Sequence[float]] | None,
    *,
    n: int,
    response_length: int,
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """Build the rollout output fields (module docstring) from per-sample token lists.

    Args:
        prompt_ids: ``[batch, prompt_len]`` left-padded prompts.
        prompt_mask: ``[batch, prompt_len]`` their attention mask.
        response_token_ids: ``batch * n`` token lists, sample ``j`` of prompt ``i`` at
            index ``i * n + j``; each list holds the generated tokens including the EOS that
            ended it (if any) and nothing after it, at most ``response_length`` long.
        response_log_probs: per-token log-probs matching ``response_token_ids`` (same
            lengths), or ``None`` to omit ``rollout_log_probs``.
        n: samples per prompt.
        response_length: the response dimension ``R`` of the outputs.
        pad_token_id: id written after each response.

    Returns:
        dict of the output tensors (int64, log-probs float32), on ``prompt_ids.device``.

    Raises:
        ValueError: counts or lengths that do not fit (the offending sample is named).
    """
    batch = prompt_ids.shape[0]
    if len(response_token_ids) != batch * n:
        raise ValueError(f"expected batch * n = {batch} * {n} responses, got {len(response_token_ids)}")
    if response_log_probs is not None and len(response_log_probs) != len(response_token_ids):
        raise ValueError(f"got {len(response_log_probs)} log-prob lists for {len(response_token_ids)} responses")
    responses = torch.full((batch * n, response_length), pad_token_id, dtype=torch.long)
    log_probs = torch.zeros((batch * n, response_length), dtype=torch.float32)
    lengths = torch.zeros(batch * n, dtype=torch.long)
    for i, tokens in enumerate(response_token_ids):
        length = len(tokens)
        if length > response_length:
            raise ValueError(f"response {i} has {length} tokens, more than response_length={response_length}")
        lengths[i] = length
        if length:
            responses[i, :length] = torch.as_tensor(list(tokens), dtype=torch.long)
        if response_log_probs is not None:
            if len(response_log_probs[i]) != length:
                raise ValueError(f"response {i} has {length} tokens but {len(response_log_probs[i])} log-probs")
            if length:
                log_probs[i, :length] = torch.as_tensor(list(response_log_probs[i]), dtype=torch.float32)
    device = prompt_ids.device
    response_mask = (torch.arange(response_length).unsqueeze(0) < lengths.unsqueeze(1)).long()
    prompts = prompt_ids.long().repeat_interleave(n, dim=0)
    prompt_mask = prompt_mask.long().repeat_interleave(n, dim=0)
    responses, response_mask = responses.to(device), response_mask.to(device)
    out = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=-1),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=-1),
        "position_ids": position_ids_for_rollout(prompt_mask, response_length),
        "response_mask": response_mask,
    }
    if response_log_probs is not None:
        out["rollout_log_probs"] = log_probs.to(device)
    return out


def rollout_output(prompts: DataProto, tensors: dict[str, torch.Tensor], n: int) -> DataProto:
    """Wrap rollout tensors (``[batch * n, ...]``) in a DataProto carrying the prompts' per-row
    objects repeated ``n`` times (interleaved, like the tensors) and the prompts' ``meta_info``."""
    index = torch.arange(len(prompts)).repeat_interleave(n).numpy()
    non_tensors = {k: v[index] for k, v in prompts.non_tensor_batch.items()}
    return DataProto.from_dict(tensors, non_tensors, dict(prompts.meta_info))


def read_prompts(prompts: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of a prompt DataProto, with clear errors when missing."""
    if not isinstance(prompts, DataProto):
        raise TypeError(f"generate_sequences expects a DataProto, got {type(prompts).__name__}")
    if prompts.batch is None:
        raise ValueError("the prompt DataProto has no tensor fields; it needs 'input_ids' and 'attention_mask'")
    missing = [k for k in ("input_ids", "attention_mask") if k not in prompts.batch.keys()]
    if missing:
        raise ValueError(f"the prompt DataProto lacks {missing}; present: {sorted(prompts.batch.keys())}")
    return prompts.batch["input_ids"], prompts.batch["attention_mask"]


__all__ = ["check_left_padded", "prompt_token_lists", "position_ids_for_rollout", "assemble_rollout_batch",
           "rollout_output", "read_prompts"]
