"""The agent loop in a generation replica, built from ``rollout.agent`` (multi-turn tool-using rollouts).

:class:`ReplicaAgent` is what a rollout host (:class:`~megaflow.workers.rollout_host.RolloutHost`,
in the colocated actor or a split-placement rollout worker) runs instead of single-turn
generation when ``rollout.agent.enabled``: :func:`~megaflow.agent.vllm_agent.generate_agent_sequences`
on the rank's engine shard. Rank 0 of the replica's generation TP group (its first global
rank) is the tool rank: it loads the tokenizer, renders the chat template, parses calls and
runs the tools, and broadcasts every turn request (so every TP rank feeds its engine the
same observation tokens) over a gloo group of the replica's ranks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megaflow.protocol import DataProto

if TYPE_CHECKING:
    from megaflow.config.schema import Config

def tokenizer_name(cfg: Config) -> str:
    """``model.tokenizer`` (a built-in name or a directory), else ``model.path``.

    Raises:
        ValueError: neither is set.
    """
    name = cfg.model.tokenizer if cfg.model.tokenizer is not None else cfg.model.path
    if name is None:
        raise ValueError("rollout.agent.enabled needs model.tokenizer or model.path (the chat template)")
    return name


def build_renderer(tokenizer: Any) -> Any:
    """The tokenizer's :class:`~megaflow.agent.template.ChatRenderer`; an assistant turn ends
    with the tokenizer's EOS token (``<|im_end|>`` for ChatML chat models).

    Raises:
        ValueError: no chat template, no EOS token, or a template the renderer refuses
            (no tool role, EOS not ending an assistant turn).
    """
    from megaflow.agent.template import ChatRenderer

    if not tokenizer.eos_token:
        raise ValueError("the tokenizer has no EOS token to end an assistant turn with")
    return ChatRenderer(tokenizer, tokenizer.eos_token)


class ReplicaAgent:
    """One rank's agent loop (module docstring).

    Args:
        cfg: the run's config (``rollout.agent``, ``rollout.response_length``,
            ``data.max_prompt_length``, ``model.tokenizer`` / ``model.path``).
        rank: the worker's global rank.
        tp_group_ranks: the generation TP groups (global ranks), one list per replica; with
            more than one rank per group every rank must build its :class:`ReplicaAgent`
            (the groups are created collectively).
    """

    def __init__(self, cfg: Config, *, rank: int, tp_group_ranks: list[list[int]]) -> None:
        from megaflow.agent.loop import AgentLimits

        agent = cfg.rollout.agent
        self.limits = AgentLimits(max_turns=agent.max_turns, response_length=cfg.rollout.response_length,
                                  tool_time_s=agent.tool_time_s)
        self.prompt_length = cfg.data.max_prompt_length
        group = next(g for g in tp_group_ranks if rank in g)
        self.is_tool_rank = rank == group[0]
        self.broadcast = _replica_broadcast(tp_group_ranks, group) if len(group) > 1 else None
        self.renderer = self.decode = None
        if self.is_tool_rank:
            from megaflow.data.tokenizer import get_tokenizer

            tokenizer = get_tokenizer(tokenizer_name(cfg))
            self.renderer = build_renderer(tokenizer)
            self.decode = tokenizer.decode

    def generate(self, engine: Any, prompts: DataProto) -> DataProto:
        """Multi-turn rollout of ``prompts`` (one trajectory per row) on ``engine``.

        Returns:
            The rollout batch of :mod:`megaflow.agent.batch` (``prompts`` ``data.max_prompt_length``
            wide), with the per-row ``agent_*`` counts and ``agent_text``; the input's
            non-tensor fields are not echoed (the controller joins them).

        Raises:
            AgentLoopError: the tool rank failed (on every rank of the replica).
        """
        from megaflow.agent.vllm_agent import generate_agent_sequences

        kwargs = {} if self.broadcast is None else {"broadcast": self.broadcast}
        out = generate_agent_sequences(engine, prompts, self.renderer, self.decode, self.limits,
                                       is_tool_rank=self.is_tool_rank, prompt_length=self.prompt_length, **kwargs)
        non_tensors = {k: v for k, v in out.non_tensor_batch.items() if k not in prompts.non_tensor_batch}
        meta = {k: v for k, v in out.meta_info.items() if k != "agent_metrics"}  # the controller's, over all rows
        return DataProto(out.batch, non_tensors, meta)


def _replica_broadcast(tp_group_ranks: list[list[int]], group: list[int]) -> Any:
    """A broadcast from ``group[0]`` over a gloo group of ``group`` (every group created on every rank)."""
    import torch.distributed as dist

    from megaflow.agent.loop import tp_broadcaster

    mine = None
    for ranks in tp_group_ranks:  # new_group is collective over the whole world, in the same order
        pg = dist.new_group(ranks, backend="gloo")
        if ranks == group:
            mine = pg
    return tp_broadcaster(mine, src=group[0])


__all__ = ["ReplicaAgent", "build_renderer", "tokenizer_name"]
