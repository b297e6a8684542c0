"""Prompt dataset: verl-layout rows -> chat-templated, left-padded prompt tensors.

The equivalent of verl's ``RLHFDataset``: every prompt is rendered with the tokenizer's
chat template (``add_generation_prompt=True``), tokenized once at construction, and
left-padded to ``max_prompt_length`` when read. Prompts longer than
``max_prompt_length`` are dropped (and counted) or rejected, by configuration.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from megaflow.data.io import DatasetFormatError, PromptRecord, load_records
from megaflow.protocol import DataProto

logger = logging.getLogger(__name__)

OVERLONG_MODES = ("filter", "error")


class RLHFDataset(Dataset):
    """Prompts from parquet/JSONL files in verl's layout (see :mod:`megaflow.data.io`).

    Args:
        files: one path or a list of paths (``.parquet`` or ``.jsonl``), read in order.
        tokenizer: a Hugging Face tokenizer (or :func:`megaflow.data.get_tokenizer`'s).
        max_prompt_length: prompt length in tokens after templating; items are
            left-padded to exactly this length.
        prompt_key: the column holding the chat messages.
        overlong_prompts: ``"filter"`` drops longer prompts (``num_filtered_overlong``
            says how many, and a warning is logged); ``"error"`` raises on the first.
        use_chat_template: render with ``tokenizer.apply_chat_template(messages,
            add_generation_prompt=True)``. When False the message contents are joined
            with newlines and encoded with the tokenizer's special tokens (BOS).
        chat_template_kwargs: extra keyword arguments for ``apply_chat_template``.
        max_samples: keep only the first ``max_samples`` rows (before filtering).

    Each item is a dict with ``input_ids``, ``attention_mask``, ``position_ids``
    (``[max_prompt_length]`` int64; position ids count real tokens from 0, pads get 0)
    and the non-tensor fields ``raw_prompt`` (the messages), ``data_source``,
    ``ground_truth``, ``extra_info`` and ``index`` (``extra_info["index"]`` or the row's
    position across all files).

    Raises:
        FileNotFoundError, DatasetFormatError: see :func:`megaflow.data.io.load_records`.
        ValueError: bad arguments; a prompt that cannot be templated or tokenized, or is
            over-long in ``"error"`` mode (file and row named); nothing left after filtering.
    """

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        *,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        overlong_prompts: str = "filter",
        use_chat_template: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        max_samples: int | None = None,
    ):
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        if overlong_prompts not in OVERLONG_MODES:
            raise ValueError(f"overlong_prompts must be one of {OVERLONG_MODES}, got {overlong_prompts!r}")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad_token_id; set one (get_tokenizer uses the EOS token)")
        if use_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template; pass use_chat_template=False to encode the raw "
                "message contents instead"
            )
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.use_chat_template = use_chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        records = load_records(files, prompt_key=prompt_key)
        if max_samples is not None:
            records = records[:max_samples]
        self.num_rows_read = len(records)
        token_ids = self._tokenize_all(records)
        self.records, self.prompt_ids = self._apply_length_limit(records, token_ids, overlong_prompts)
        self.num_filtered_overlong = self.num_rows_read - len(self.records)
        if self.num_filtered_overlong:
            logger.warning(
                "filtered %d of %d prompts longer than max_prompt_length=%d tokens",
                self.num_filtered_overlong, self.num_rows_read, max_prompt_length,
            )
        if not self.records:
            if self.num_rows_read == 0:
                raise ValueError(f"the prompt dataset files contain no rows: {files}")
            raise ValueError(
                f"no prompts left: all {self.num_rows_read} prompts are longer than "
                f"max_prompt_length={max_prompt_length}"
            )

    # ------------------------------------------------------------------ building
    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text of one conversation, ready to encode without extra special tokens."""
        if self.use_chat_template:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
            )
        return "\n".join(m["content"] for m in messages)

    def _tokenize_all(self, records: list[PromptRecord]) -> list[list[int]]:
        texts = []
        for record in records:
            try:
                texts.append(self.render(record.messages))
            except Exception as exc:
                raise DatasetFormatError(
                    f"{record.location}: cannot apply the chat template to column 'prompt': {exc}"
                ) from exc
        add_special = not self.use_chat_template
        try:
            return list(self.tokenizer(texts, add_special_tokens=add_special)["input_ids"]) if texts else []
        except Exception:  # noqa: BLE001 - any tokenizer failure: find the offending row for the message
            out = []
            for record, text in zip(records, texts, strict=True):
                try:
                    out.append(self.tokenizer(text, add_special_tokens=add_special)["input_ids"])
                except Exception as exc:
                    raise DatasetFormatError(
                        f"{record.location}: cannot tokenize column 'prompt' ({text[:80]!r}): {exc}"
                    ) from exc
            return out

    def _apply_length_limit(self, records: list[PromptRecord], token_ids: list[list[int]],
                            mode: str) -> tuple[list[PromptRecord], list[np.ndarray]]:
        kept_records, kept_ids = [], []
        for record, ids in zip(records, token_ids, strict=True):
            if len(ids) > self.max_prompt_length:
                if mode == "error":
                    raise ValueError(
                        f"{record.location}: prompt of {len(ids)} tokens exceeds max_prompt_length="
                        f"{self.max_prompt_length}; raise max_prompt_length or set "
                        "overlong_prompts='filter' to drop such prompts"
                    )
                continue
            kept_records.append(record)
            kept_ids.append(np.asarray(ids, dtype=np.int64))
        return kept_records, kept_ids

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict[str, Any]:
        record, ids = self.records[i], self.prompt_ids[i]
        length, num_pad = len(ids), self.max_prompt_length - len(ids)
        input_ids = torch.full((self.max_prompt_length,), self.pad_token_id, dtype=torch.int64)
        input_ids[num_pad:] = torch.from_numpy(ids)
        attention_mask = torch.zeros(self.max_prompt_length, dtype=torch.int64)
        attention_mask[num_pad:] = 1
        position_ids = torch.zeros(self.max_prompt_length, dtype=torch.int64)
        position_ids[num_pad:] = torch.arange(length)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "raw_prompt": record.messages,
            "data_source": record.data_source,
            "ground_truth": record.ground_truth,
            "extra_info": record.extra_info,
            "index": record.index,
        }


def collate_fn(items: Sequence[dict[str, Any]]) -> DataProto:
    """Stack dataset items into a :class:`DataProto`.

    Tensor values are stacked to ``[batch, ...]``; every other value becomes a 1-D numpy
    object array (one entry per item, nested lists/dicts kept as Python objects).

    Raises:
        ValueError: empty input or items with different keys.
    """
    if not items:
        raise ValueError("collate_fn got no items")
    keys = list(items[0])
    for j, item in enumerate(items):
        if list(item) != keys:
            raise ValueError(f"item {j} has keys {sorted(item)}, item 0 has {sorted(keys)}")
    tensors = {k: torch.stack([it[k] for it in items]) for k in keys if isinstance(items[0][k], torch.Tensor)}
    non_tensors = {}
    for k in keys:
        if k not in tensors:
            column = np.empty(len(items), dtype=object)
            for j, it in enumerate(items):
                column[j] = it[k]
            non_tensors[k] = column
    return DataProto.from_dict(tensors, non_tensors)
