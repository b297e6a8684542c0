"""Sample generations: what the policy writes, next to what the reward made of it.

A reward of 0 and a gradient norm of 0 look the same whether the model rambles past the
response limit or the framework is broken; a few decoded samples tell them apart. Every
``trainer.generations_every`` steps (from the step's batch) and at every validation (the
first validation prompts, the same ones each time), :func:`sample_generations` picks
``trainer.generations_count`` rows and :meth:`megaflow.utils.tracking.Tracking.log_generations`
writes them to the console (shortened), to ``generations.jsonl`` in the run directory and
to TensorBoard as text. Multi-turn rows (``rollout.agent``) also carry their conversation
(``trajectory``: every message marked by its role, ``[tool NAME]`` before each observation),
and every validation appends a few of them to ``agent_trajectories.txt`` in the run directory
(:func:`write_trajectories`).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from megaflow.protocol import DataProto
from megaflow.rewards.manager import REWARD_FIELD_PREFIX


def _pick_rows(batch: DataProto, count: int) -> list[int]:
    """The first row of each of the first ``count`` prompt groups (``uid``), else the first rows."""
    uids = batch.non_tensor_batch.get("uid")
    if uids is None:
        return list(range(min(count, len(batch))))
    first: dict[Any, int] = {}
    for i, uid in enumerate(uids.tolist()):
        first.setdefault(uid, i)
        if len(first) == count:
            break
    return list(first.values())


def sample_generations(batch: DataProto, decode: Callable[[list[int]], str], count: int) -> list[dict[str, Any]]:
    """Up to ``count`` decoded samples of a scored rollout batch, one per prompt group.

    Args:
        batch: ``prompts`` ``[B, P]`` (left-padded; ``attention_mask[:, :P]`` marks the real
            tokens), ``responses`` / ``response_mask`` ``[B, R]``, ``token_level_scores``
            ``[B, R]``; optional non-tensor ``uid``, ``data_source``, ``ground_truth`` and the
            reward function's ``reward_<part>`` fields.
        decode: token ids -> text (the tokenizer's ``decode``).
        count: samples wanted.

    Returns:
        ``[{"data_source", "prompt", "response", "response_tokens", "ground_truth", "reward":
        {"total": sequence reward, <part>: value, ...}}]``: ``total`` is
        ``token_level_scores`` summed over the response (reward-model scores included); multi-turn
        rows add ``"trajectory"`` (their ``agent_text``) and ``"response"`` holds the sampled
        tokens of all turns;
        the parts are the reward function's named values (``score``, ``acc``, ``format``,
        ...; NaN ones left out). Padding and tokens after the first EOS are not decoded.
    """
    if count <= 0 or len(batch) == 0:
        return []
    b, nt = batch.tensors, batch.non_tensor_batch
    width = b["prompts"].shape[1]
    prompt_mask = b["attention_mask"][:, :width].bool()
    response_mask = b["response_mask"].bool()
    totals = b["token_level_scores"].sum(-1)
    parts = {k[len(REWARD_FIELD_PREFIX):]: v for k, v in nt.items() if k.startswith(REWARD_FIELD_PREFIX)}
    records = []
    for i in _pick_rows(batch, count):
        reward = {"total": float(totals[i])}
        reward.update({name: float(values[i]) for name, values in parts.items()
                       if not math.isnan(float(values[i]))})
        records.append({
            "data_source": str(nt["data_source"][i]) if "data_source" in nt else None,
            "prompt": decode(b["prompts"][i][prompt_mask[i]].tolist()),
            "response": decode(b["responses"][i][response_mask[i]].tolist()),
            "response_tokens": int(response_mask[i].sum()),
            "ground_truth": _plain(nt["ground_truth"][i]) if "ground_truth" in nt else None,
            "reward": reward})
        if "agent_text" in nt:
            records[-1]["trajectory"] = str(nt["agent_text"][i])
    return records


#: The file in the run directory that every validation appends sample trajectories to.
TRAJECTORIES_FILE = "agent_trajectories.txt"


def write_trajectories(batch: DataProto, path: Path, *, step: int, split: str, count: int) -> int:
    """Append up to ``count`` multi-turn rows of ``batch`` (one per prompt group) to ``path`` as text.

    Each block: a header with the step, split, row and sequence reward (``token_level_scores``
    summed, when scored), then the row's ``agent_text``. Returns the blocks written (0 for
    a batch without ``agent_text``).
    """
    if "agent_text" not in batch.non_tensor_batch or count <= 0:
        return 0
    rows = _pick_rows(batch, count)
    scores = batch.tensors["token_level_scores"].sum(-1) if "token_level_scores" in batch.tensors.keys() else None
    with path.open("a", encoding="utf-8") as file:
        for i in rows:
            reward = "" if scores is None else f", reward {float(scores[i]):.4g}"
            file.write(f"===== step {step} {split} row {i}{reward}\n{batch.non_tensor_batch['agent_text'][i]}\n\n")
    return len(rows)


def _plain(value: Any) -> Any:
    """A JSON-friendly ground truth (numpy scalars and arrays to Python values)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value if isinstance(value, (str, int, float, bool, type(None), list, dict)) else str(value)


__all__ = ["TRAJECTORIES_FILE", "sample_generations", "write_trajectories"]
