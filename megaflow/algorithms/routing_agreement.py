"""How often the trainer routes a response token as the rollout engine did (mixture-of-experts
routing replay, issue 34 item 4)."""
from __future__ import annotations

import torch


def routing_agreement(engine_routing: torch.Tensor, trainer_routing: torch.Tensor,
                      response_mask: torch.Tensor) -> tuple[int, int]:
    """Count the (response token, MoE layer) pairs whose top-k expert *set* is the same for the
    rollout engine and the trainer.

    A pair counts when its response token has ``response_mask`` != 0 and both routings exist
    there (ids >= 0: the engine never feeds the last sampled token through the model, see
    :data:`megaflow.rollout.routing.NO_ROUTING`). Sets, not lists: the order of the k ids is
    the router's score order, which does not change which experts compute the token.

    Args:
        engine_routing: ``routed_experts`` ``[batch, seq, layers, topk]`` (integer expert ids,
            -1 where no routing exists; the response is the last ``R`` positions).
        trainer_routing: ``old_routed_experts``, the same shape.
        response_mask: ``[batch, R]``.

    Returns:
        ``(agreeing, counted)`` pairs; the agreement is ``agreeing / counted``.

    Raises:
        ValueError: mismatched shapes.
    """
    if engine_routing.shape != trainer_routing.shape or engine_routing.ndim != 4:
        raise ValueError(f"routings must both be [batch, seq, layers, topk], got {tuple(engine_routing.shape)} "
                         f"and {tuple(trainer_routing.shape)}")
    rows, seq = engine_routing.shape[:2]
    if response_mask.ndim != 2 or response_mask.shape[0] != rows or response_mask.shape[1] > seq:
        raise ValueError(f"response_mask {tuple(response_mask.shape)} must be [batch={rows}, R <= {seq}]")
    resp = response_mask.shape[1]
    engine, trainer = (r[:, seq - resp:].long() for r in (engine_routing, trainer_routing))
    routed = (engine >= 0).all(-1) & (trainer >= 0).all(-1)  # [batch, R, layers]
    counted = routed & (response_mask != 0)[:, :, None]
    same = (engine.sort(dim=-1).values == trainer.sort(dim=-1).values).all(-1)
    return int((same & counted).sum()), int(counted.sum())


__all__ = ["routing_agreement"]
