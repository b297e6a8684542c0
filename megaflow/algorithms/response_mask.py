"""Response masks built by position from the generated token ids.

A response is valid up to and including its first end-of-sequence token; everything
after that is padding. The mask is built from the *position* of the first EOS, never
by comparing ids with the pad id: many tokenizers (SmolLM2, several Qwen/Llama chat
models) use ``pad_token_id == eos_token_id``, and an id comparison would then mask the
real EOS too, or keep padding that happens to equal a normal token.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from megaflow.algorithms._checks import check_tensor


def _eos_id_tensor(eos_token_ids: int | Iterable[int], device: torch.device) -> torch.Tensor:
    if isinstance(eos_token_ids, torch.Tensor):
        ids = eos_token_ids.reshape(-1).tolist()
    elif isinstance(eos_token_ids, int):
        ids = [eos_token_ids]
    else:
        ids = list(eos_token_ids)
    if not ids:
        raise ValueError("eos_token_ids must name at least one token id, got an empty collection")
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise TypeError(f"eos_token_ids must be ints, got {token_id!r} ({type(token_id).__name__})")
    return torch.tensor(ids, dtype=torch.long, device=device)


def compute_response_mask(
    responses: torch.Tensor,
    eos_token_ids: int | Iterable[int],
    *,
    dtype: torch.dtype = torch.long,
) -> torch.Tensor:
    """Mask of the valid tokens of each response: up to and including the first EOS.

    ``mask[b, t] = 1`` iff no EOS occurs in ``responses[b, :t]`` (strictly before t).
    So the first EOS itself is kept (its log-prob is trained: the policy must learn to
    stop), every later position is masked, and a response without any EOS (truncated
    at the length limit) is valid over its whole length.

    Args:
        responses: ``[batch, response_len]`` integer token ids (right padded with any id,
            including the EOS id itself).
        eos_token_ids: one id or several (e.g. ``<|im_end|>`` and ``<|endoftext|>``);
            the first occurrence of any of them ends the response.
        dtype: dtype of the returned mask (``torch.long`` default; ``torch.bool`` or a
            float dtype are fine).

    Returns:
        ``[batch, response_len]`` mask of ``dtype``, 1 for valid tokens.

    Raises:
        TypeError: ``responses`` is not an integer tensor, or an EOS id is not an int.
        ValueError: ``responses`` is not 2-D or ``eos_token_ids`` is empty.
    """
    check_tensor("responses", responses, ndim=2)
    if responses.is_floating_point() or responses.is_complex() or responses.dtype == torch.bool:
        raise TypeError(f"responses must hold integer token ids, got dtype {responses.dtype}")
    eos_ids = _eos_id_tensor(eos_token_ids, responses.device)
    is_eos = torch.isin(responses, eos_ids).to(torch.int32)
    num_eos_before = torch.cumsum(is_eos, dim=-1) - is_eos
    return (num_eos_before == 0).to(dtype)


def response_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """Number of valid tokens per response, ``[batch]`` int64 (mask non-zero = valid)."""
    check_tensor("response_mask", response_mask, ndim=2)
    return (response_mask != 0).sum(dim=-1)
