"""Multi-turn rollouts on megaflow's in-process vLLM engine (:class:`~megaflow.rollout.vllm_rollout.VLLMRollout`).

:class:`VLLMTurnEngine` feeds the agent loop's turn requests to the synchronous engine's
``add_request``/``step`` loop (token-id prompts, the rollout's own per-request sampling
parameters: stop ids, log-probs of the sampled tokens, seeds); :func:`generate_agent_sequences`
runs a prompt batch as trajectories and returns the rollout batch
(:mod:`megaflow.agent.batch`). Every rank of a generation replica calls it in lockstep, as
it calls ``generate_sequences``; rank 0 of the replica runs the tools.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from megaflow.agent.batch import assemble_agent_batch
from megaflow.agent.loop import AgentLimits, AgentLoop, Broadcast, TurnRequest, _no_broadcast
from megaflow.agent.metrics import render_trajectory, trajectory_metrics
from megaflow.agent.template import ChatRenderer
from megaflow.protocol import DataProto
from megaflow.rollout.sampling import SamplingConfig, request_seeds


class VLLMTurnEngine:
    """The agent loop's :class:`~megaflow.agent.loop.TurnEngine` on a ``VLLMRollout``'s engine."""

    def __init__(self, rollout: Any, sampling: SamplingConfig) -> None:
        self.rollout = rollout
        self.sampling = dataclasses.replace(sampling, n=1)
        self.engine = rollout._llm.llm_engine
        self._unfinished: set[str] = set()

    def add(self, key: str, request: TurnRequest) -> None:
        turn = dataclasses.replace(self.sampling, response_length=request.max_tokens, seed=request.seed)
        prompts, params = self.rollout._requests([request.prompt_ids], turn)
        self.engine.add_request(key, prompts[0], params[0])
        self._unfinished.add(key)

    def abort_all(self) -> None:
        if self._unfinished:
            self.engine.abort_request(sorted(self._unfinished))
            self._unfinished.clear()

    def step(self) -> list[tuple[str, list[int], list[float]]]:
        from megaflow.rollout.vllm_rollout import _sampled_log_probs

        finished = []
        for output in self.engine.step():
            if output.finished:
                self._unfinished.discard(output.request_id)
                completion = output.outputs[0]
                finished.append((output.request_id, list(completion.token_ids), _sampled_log_probs(completion)))
        return finished


#: The prompt batch's non-tensor fields :func:`batch_rows` reads (a row's messages, tools, environment).
AGENT_INPUT_KEYS = ("raw_prompt", "extra_info", "agent_name")


def batch_rows(prompts: DataProto) -> list[dict[str, Any]]:
    """The environment rows of a prompt batch: ``raw_prompt`` as ``prompt``, ``extra_info``, ``agent_name``."""
    data = prompts.non_tensor_batch
    if "raw_prompt" not in data:
        raise ValueError("multi-turn rollouts need the prompts' messages: the batch has no 'raw_prompt' column")
    rows = []
    for i in range(len(data["raw_prompt"])):
        extra_info = data["extra_info"][i] if "extra_info" in data else {}
        agent_name = data["agent_name"][i] if "agent_name" in data else (extra_info or {}).get("agent_name")
        rows.append({"prompt": list(data["raw_prompt"][i]), "extra_info": extra_info, "agent_name": agent_name})
    return rows


def generate_agent_sequences(rollout: Any, prompts: DataProto, renderer: ChatRenderer | None,
                             decode: Callable[[Sequence[int]], str] | None, limits: AgentLimits, *,
                             is_tool_rank: bool = True, broadcast: Broadcast = _no_broadcast,
                             sampling: SamplingConfig | None = None, prompt_length: int = 0) -> DataProto:
    """Run each prompt ``n`` times as a multi-turn trajectory; the rollout batch of :mod:`megaflow.agent.batch`.

    Args:
        rollout: this rank's ``VLLMRollout``.
        prompts: a prompt batch with ``raw_prompt`` (and ``extra_info``) per row; its tensors
            are not used (the first prompt is rendered from the messages and the row's tools).
        renderer, decode: the chat template and detokenizer (tool rank; None elsewhere).
        limits: turn, token and tool-time limits (``limits.response_length`` is the
            response span).
        is_tool_rank, broadcast: the replica's rank 0 and its broadcast (see
            :class:`~megaflow.agent.loop.AgentLoop`).
        sampling: overrides ``rollout.sampling`` (then ``prompts.meta_info`` applies).
        prompt_length: the width of ``prompts`` (0: the longest first-turn prompt's), see
            :func:`~megaflow.agent.batch.assemble_agent_batch`.

    Returns:
        ``len(prompts) * n`` rows, the ``n`` trajectories of a prompt adjacent, with the
        prompts' other per-row fields repeated, the per-row counts and ``agent_text`` (the
        readable conversation, :func:`~megaflow.agent.metrics.render_trajectory`);
        ``meta_info["agent_metrics"]`` holds :func:`~megaflow.agent.metrics.trajectory_metrics`.
    """
    sampling = (sampling or rollout.sampling).override(prompts.meta_info)
    rows = [row for row in batch_rows(prompts) for _ in range(sampling.n)]
    base_seed = sampling.seed if sampling.seed is not None else rollout.config.seed
    seeds = request_seeds(base_seed, len(rows), stream=rollout._num_calls + 1)
    rollout._num_calls += 1
    loop = AgentLoop(VLLMTurnEngine(rollout, sampling), renderer, decode, limits,
                     eos_token_ids=sampling.eos_token_ids, max_model_len=rollout.max_model_len,
                     is_tool_rank=is_tool_rank, broadcast=broadcast)
    rollout.wake_up()
    from megaflow.rollout.vllm_rollout import preserve_rng_state

    with preserve_rng_state():
        trajectories = loop.run(rows, seeds)
    rollout.sleep()
    tensors, counts = assemble_agent_batch(trajectories, response_length=limits.response_length,
                                           pad_token_id=sampling.pad_token_id, prompt_length=prompt_length)
    index = np.arange(len(prompts)).repeat(sampling.n)
    non_tensors = {k: v[index] for k, v in prompts.non_tensor_batch.items()}
    counts["agent_text"] = np.array([render_trajectory(t) for t in trajectories], dtype=object)
    meta_info = {**prompts.meta_info, "agent_metrics": trajectory_metrics(trajectories)}
    return DataProto.from_dict(tensors, {**non_tensors, **counts}, meta_info)
