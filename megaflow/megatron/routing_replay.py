"""Routing replay scoped to one model: record the experts each token was routed to, and route
a later forward through given experts instead of the router's own top-k (issue 34, item 4).

megatron-core 0.16.1 gives every ``TopKRouter`` built with ``moe_enable_routing_replay`` a
``RouterReplay`` that its top-k consults (``moe_utils.topk_softmax_with_capacity``), but
registers each one in the class-global ``RouterReplay.global_router_replay_instances`` and
drives them only through static methods over that list. Two models in one process (actor
and reference colocated) then share replay targets, the failure verl#7786 describes.
:class:`RoutingReplay` instead holds exactly its own model's ``RouterReplay`` objects, in
layer order, and removes them from megatron-core's global list, so nothing global reaches
them. It drives them through megatron-core's own per-instance API (record, target indices,
action), so the routing itself is megatron-core's.

Replayed probabilities are the router's scores gathered at the replayed experts
(``RouterReplay.get_replay_topk``), so a replayed expert outside the router's current top-k
still receives a router gradient.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


def _router_replays(model: torch.nn.Module) -> list:
    """The ``RouterReplay`` of every MoE router of ``model``, in module (= layer) order."""
    replays = [m.router_replay for m in model.modules() if getattr(m, "router_replay", None) is not None]
    if not replays:
        raise ValueError("the model has no MoE router with routing replay: build it with "
                         "moe_enable_routing_replay=True (a mixture-of-experts model)")
    return replays


def _recording_replay_topk(replay):
    """``replay.get_replay_topk`` that records the default top-k indices of the scores, then
    replays (megatron-core's ``RouterReplay.get_replay_topk``)."""
    method = type(replay).get_replay_topk

    def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        replay.record_indices(own.detach())
        return method(replay, scores, topk, num_groups, group_topk, default_compute_topk)

    return get_replay_topk


class RoutingReplay:
    """Record / replay the top-k experts of one model's MoE layers (this pipeline stage's).

    Args:
        model: a megatron-core GPTModel (or one wrapped in DDP) built with
            ``moe_enable_routing_replay=True``.

    Raises:
        ValueError: the model has no router with routing replay.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self._replays = _router_replays(model)
        mine = {id(r) for r in self._replays}
        registry = RouterReplay.global_router_replay_instances
        registry[:] = [r for r in registry if id(r) not in mine]

    @property
    def num_layers(self) -> int:
        """MoE layers of this model on this rank."""
        return len(self._replays)

    @contextlib.contextmanager
    def record(self) -> Iterator[list[torch.Tensor]]:
        """Within the block, forwards record their routing; the yielded list is filled on exit
        with one ``[tokens, topk]`` int64 tensor of expert ids per MoE layer (the last forward's;
        tokens in the order the layer saw them: ``[seq, batch]`` flattened)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        recorded: list[torch.Tensor] = []
        with self._action(RouterReplayAction.RECORD):
            yield recorded
            recorded.extend(r.get_recorded_indices() for r in self._replays)

    @contextlib.contextmanager
    def replay(self, targets: Sequence[torch.Tensor], *, record_own: bool = False) -> Iterator[list[torch.Tensor]]:
        """Within the block, one forward routes every token of MoE layer ``i`` to
        ``targets[i]`` (``[tokens, topk]`` expert ids, as :meth:`record` yields them).

        With ``record_own`` the yielded list is filled on exit with the top-k each router would
        have chosen itself (``[tokens, topk]`` per MoE layer, megatron-core's own top-k of the
        same scores), i.e. the router's choice given the layer input of the replayed forward;
        otherwise it stays empty.

        Raises:
            ValueError: not one target per MoE layer of this model.
        """
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if len(targets) != len(self._replays):
            raise ValueError(f"{len(targets)} routing targets for {len(self._replays)} MoE layers")
        for replay, target in zip(self._replays, targets, strict=True):
            replay.set_target_indices(target.long())
        own: list[torch.Tensor] = []
        with self._action(RouterReplayAction.REPLAY_FORWARD), self._own_choice(record_own):
            yield own
            if record_own:
                own.extend(r.get_recorded_indices() for r in self._replays)

    @contextlib.contextmanager
    def _own_choice(self, active: bool) -> Iterator[None]:
        """While active, each replaying router also records the top-k it would choose itself: its
        ``get_replay_topk`` (an instance attribute shadowing megatron-core's method, removed on
        exit) runs the default top-k on the scores before replaying."""
        if not active:
            yield
            return
        for replay in self._replays:
            replay.get_replay_topk = _recording_replay_topk(replay)
        try:
            yield
        finally:
            for replay in self._replays:
                del replay.get_replay_topk

    @contextlib.contextmanager
    def _action(self, action) -> Iterator[None]:
        for replay in self._replays:
            replay.set_router_replay_action(action)
        try:
            yield
        finally:
            for replay in self._replays:
                replay.clear_router_replay_action()
                replay.clear_indices()


__all__ = ["RoutingReplay"]
