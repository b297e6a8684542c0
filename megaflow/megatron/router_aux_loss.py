"""The auxiliary router losses of a mixture-of-experts update, normalised over the whole
mini-batch like the policy loss (issue 34, item 2).

Definitions (``E`` experts, top-``k`` routing, sums over the MoE layers of the model):

* load balancing, sequence-wise (DeepSeek-V3 technical report, eq. 17-20): for sequence ``s``
  with ``T_s`` real tokens (prompt and response), ``f_{s,e} = E / (k T_s) * #{t : e routed for
  t}`` and ``P_{s,e} = (1/T_s) sum_t softmax(z_t)_e``; the loss is ``(1/N) sum_s sum_e f_{s,e}
  P_{s,e}`` (1 per layer when perfectly balanced);
* router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): ``(1/N) sum_s (1/T_s) sum_t
  logsumexp(z_t)^2``;

where ``z_t`` are the router logits (fp32) and ``N`` is the number of sequences of the
mini-batch over all DP ranks with at least one valid response token, the engine's
:class:`~megaflow.megatron.denominators.GlobalDenominators` ``num_seqs``. Every sequence lies
in one micro-batch of one DP rank, and expert parallelism routes the same tokens through
the same (replicated) router, so both losses are independent of the DP, EP and micro-batch
split. megatron-core's own auxiliary losses are normalised per micro-batch (their gradient
is scaled by ``1 / num_microbatches``), which is why megaflow keeps them off
(:func:`megaflow.megatron.moe.moe_transformer_config_fields`) and adds these instead.

The routing counted is the one the layer used (``routing_map``, so a replayed routing is
counted as replayed); the gradient reaches the router through the softmax and the
log-sum-exp. The loss is attached to the router's output probabilities by an identity
whose backward adds the loss's gradient, scaled like the policy loss's (``dp_size`` x the
optimizer's loss scale, so that Megatron DDP's average over DP gives the mini-batch loss).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


class _AddLossGradient(torch.autograd.Function):
    """Identity on ``output``; its backward also sends ``scale`` as the gradient of ``loss``."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_shape = loss.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.loss_shape, ctx.scale, dtype=torch.float32, device=grad.device), None


def sequence_router_losses(logits: torch.Tensor, routing_map: torch.Tensor, token_mask: torch.Tensor,
                           topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence load-balancing and z-losses of one MoE layer (see the module docstring).

    Args:
        logits: ``[s, b, E]`` router logits (fp32).
        routing_map: ``[s * b, E]`` bool, the experts each token was routed to (``[s, b]``
            flattened, as megatron-core's router returns it).
        token_mask: ``[s, b]`` bool, the tokens that count (real tokens of counted rows).
        topk: experts per token ``k``.

    Returns:
        ``(balance, z)``, each ``[b]``: ``sum_e f_{s,e} P_{s,e}`` and the token mean of
        ``logsumexp(z_t)^2`` per sequence (0 for a row without counted tokens).
    """
    seq, rows, experts = logits.shape
    mask = token_mask.to(logits.dtype)
    tokens = mask.sum(0).clamp_min(1.0)  # [b]
    probs = torch.softmax(logits, dim=-1)
    mean_prob = (probs * mask[..., None]).sum(0) / tokens[:, None]  # P_{s,e}
    counts = (routing_map.view(seq, rows, experts).to(logits.dtype) * mask[..., None]).sum(0)
    fraction = counts * (experts / topk) / tokens[:, None]  # f_{s,e}
    balance = (fraction * mean_prob).sum(-1)
    z = (torch.logsumexp(logits, dim=-1).square() * mask).sum(0) / tokens
    return balance, z


class RouterAuxLoss:
    """Adds the coefficient-weighted auxiliary router losses to one model's update.

    A forward hook on every megatron-core ``TopKRouter`` of ``model`` recomputes the layer's
    fp32 router logits from the router's input (the same ``input @ weight.T`` as its gating)
    and, in training forwards inside :meth:`step` / :meth:`micro_batch`, attaches
    ``aux_coeff * balance + z_coeff * z`` of this micro-batch's sequences, each divided by the
    mini-batch's sequence count.

    Args:
        model: a GPTModel built with MoE layers (or a wrapper of one).
        aux_coeff: load-balancing coefficient (``<role>.moe_aux_loss_coeff``).
        z_coeff: z-loss coefficient (``<role>.moe_z_loss_coeff``).

    Raises:
        ValueError: the model has no MoE router.
    """

    def __init__(self, model: torch.nn.Module, *, aux_coeff: float, z_coeff: float) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not routers:
            raise ValueError("auxiliary router losses need a mixture-of-experts model: this model has no MoE router")
        self.aux_coeff, self.z_coeff = float(aux_coeff), float(z_coeff)
        self._num_seqs: int | None = None
        self._scale = 1.0
        self._mask: torch.Tensor | None = None
        self._totals = torch.zeros(2, dtype=torch.float64)
        for router in routers:
            router.register_forward_hook(self._hook)

    @contextlib.contextmanager
    def step(self, num_seqs: int, grad_scale: float) -> Iterator[None]:
        """Within the block, training forwards add the losses (``num_seqs``: the mini-batch's
        sequence count ``N``; ``grad_scale``: the backward scale of a loss share)."""
        self._num_seqs, self._scale = max(int(num_seqs), 1), float(grad_scale)
        self._totals = torch.zeros(2, dtype=torch.float64)
        try:
            yield
        finally:
            self._num_seqs, self._mask = None, None

    def micro_batch(self, lengths: torch.Tensor, counted: torch.Tensor, seq_len: int) -> None:
        """The next forward's tokens: row ``i`` has ``lengths[i]`` real tokens (left-aligned in
        ``seq_len`` positions) and counts when ``counted[i]``."""
        positions = torch.arange(seq_len)
        self._mask = ((positions[:, None] < lengths[None, :]) & counted[None, :]).contiguous()  # [s, b]

    def totals(self, groups: tuple = ()) -> dict[str, float]:
        """The step's ``moe_aux_loss`` (sum of the balance losses) and ``moe_z_loss``, without
        coefficients, summed over this rank's micro-batches and all-reduced over ``groups``
        (the DP group, then the PP group, so every layer and sequence counts once)."""
        totals = self._totals.clone()
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(totals, group=group)
        return {"moe_aux_loss": float(totals[0]), "moe_z_loss": float(totals[1])}

    def _hook(self, router: Any, args: tuple, output: tuple) -> tuple | None:
        """Forward hook of a megatron-core ``TopKRouter`` (``router.weight`` ``[E, h]``, ``router.topk``)."""
        if self._num_seqs is None or self._mask is None or not router.training or not torch.is_grad_enabled():
            return None
        probs, routing_map = output
        hidden = args[0]
        logits = torch.nn.functional.linear(hidden.float(), router.weight.float().to(hidden.device))
        mask = self._mask.to(logits.device)
        if mask.shape != logits.shape[:2]:
            raise RuntimeError(f"router input {tuple(logits.shape[:2])} does not match the micro-batch's "
                               f"tokens {tuple(mask.shape)} ([seq, batch])")
        balance, z = sequence_router_losses(logits, routing_map, mask, router.topk)
        balance, z = balance.sum() / self._num_seqs, z.sum() / self._num_seqs
        self._totals += torch.stack([balance.detach(), z.detach()]).double().cpu()
        loss = self.aux_coeff * balance + self.z_coeff * z
        return _AddLossGradient.apply(probs, loss, self._scale), routing_map


__all__ = ["RouterAuxLoss", "sequence_router_losses"]
