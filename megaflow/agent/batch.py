"""The rollout batch of multi-turn trajectories: one row per trajectory, all turns in the response.

Fields (the single-turn rollout's, :mod:`megaflow.rollout.batch`, so every later phase runs
on it unchanged)::

    prompts            [rows, prompt_len]    left-padded first-turn prompts
    responses          [rows, response_len]  all turns: sampled and observation ids, right-padded
    input_ids / attention_mask / position_ids  prompts then responses; attention 1 on every real
                                             token (observations are context)
    response_mask      [rows, response_len]  1 on sampled ids, 0 on observation ids and padding
    rollout_log_probs  [rows, response_len]  the engine's log-probs of sampled ids, 0 elsewhere

and per-row counts in ``non_tensor_batch``: ``agent_turns``, ``agent_tool_calls``,
``agent_tool_errors``, ``agent_calls`` (``(tool, error kind or None, seconds)`` per
call), ``agent_observation_tokens``, ``agent_stop_reason``,
``agent_template_ok``, ``agent_env_reward`` (NaN where the environment gave none).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from megaflow.agent.loop import Trajectory
from megaflow.rollout.batch import assemble_rollout_batch


def left_pad(rows: Sequence[Sequence[int]], pad_token_id: int, width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` ``[len(rows), max(longest, width)]`` int64, left-padded with ``pad_token_id``."""
    width = max(width, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.as_tensor(list(row), dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids, mask


def _object_column(values: Sequence) -> np.ndarray:
    """A 1-D object array holding ``values`` (lists stay lists, not a 2-D array)."""
    column = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        column[i] = value
    return column


def assemble_agent_batch(trajectories: Sequence[Trajectory], *, response_length: int,
                         pad_token_id: int,
                         prompt_length: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Tensors and per-row counts of the trajectories (module docstring).

    ``prompts`` is ``prompt_length`` wide (so that the batches of all replicas concatenate)
    unless a first-turn prompt is longer; 0: the longest prompt's width.

    Raises:
        ValueError: a trajectory longer than ``response_length``, a prompt longer than a
            non-zero ``prompt_length``, or mismatched lists.
    """
    longest = max(len(t.prompt_ids) for t in trajectories)
    if prompt_length and longest > prompt_length:
        raise ValueError(f"a first-turn prompt (chat template + the row's tools) has {longest} tokens, more than "
                         f"the batch's prompt width {prompt_length} (data.max_prompt_length)")
    for i, t in enumerate(trajectories):
        if not len(t.response_ids) == len(t.response_mask) == len(t.log_probs):
            raise ValueError(f"trajectory {i}: {len(t.response_ids)} ids, {len(t.response_mask)} mask entries, "
                             f"{len(t.log_probs)} log-probs")
    prompt_ids, prompt_mask = left_pad([t.prompt_ids for t in trajectories], pad_token_id, prompt_length)
    tensors = assemble_rollout_batch(prompt_ids, prompt_mask, [t.response_ids for t in trajectories],
                                     [t.log_probs for t in trajectories], n=1, response_length=response_length,
                                     pad_token_id=pad_token_id)
    turn_mask = torch.zeros_like(tensors["response_mask"])
    for i, t in enumerate(trajectories):
        turn_mask[i, :len(t.response_mask)] = torch.as_tensor(t.response_mask, dtype=torch.long)
    tensors["response_mask"] = turn_mask
    tensors["rollout_log_probs"] = tensors["rollout_log_probs"] * turn_mask
    counts = {
        "agent_turns": np.array([t.num_turns for t in trajectories], dtype=np.int64),
        "agent_tool_calls": np.array([t.num_tool_calls for t in trajectories], dtype=np.int64),
        "agent_tool_errors": np.array([t.num_tool_errors for t in trajectories], dtype=np.int64),
        "agent_calls": _object_column([[(c.tool, c.error, c.seconds) for c in t.calls] for t in trajectories]),
        "agent_observation_tokens": np.array([t.num_observation_tokens for t in trajectories], dtype=np.int64),
        "agent_stop_reason": np.array([t.stop_reason for t in trajectories], dtype=object),
        "agent_template_ok": np.array([t.template_ok for t in trajectories], dtype=bool),
        "agent_env_reward": np.array([np.nan if t.env_reward is None else t.env_reward for t in trajectories],
                                     dtype=np.float64),
    }
    return tensors, counts
