"""Routed experts of a rollout (routing replay, issue 34 item 4): the batch field and its layout.

A mixture-of-experts rollout can return, for every token it fed through the model, the top-k
expert ids each MoE layer routed it to, so the trainer can replay the engine's routing. The
field, aligned with ``input_ids`` (prompt then response positions)::

    routed_experts  [batch*n, prompt_len+response_len, num_moe_layers, topk]

in the smallest signed integer dtype that holds every expert id (:func:`routed_experts_dtype`:
int8 up to 127 experts, int16 up to 32,767, else int32), and ``-1`` where no routing exists:
the left padding of the prompt, the response padding, the last token of every sequence
(the engine samples it but never feeds it through the model; its routing can affect no
log-prob of the response, since position ``s`` only scores the token at ``s + 1``), and, with
the engine's prefix caching on, the prompt tokens served from its cache. Expert ids
are the model's global (logical) ids. The field is split with the tokens wherever the batch is
(:meth:`megaflow.protocol.DataProto.chunk` and friends split every tensor along dim 0).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

#: Marks a (token, layer) without routing in ``routed_experts``.
NO_ROUTING = -1


def routed_experts_dtype(num_experts: int) -> torch.dtype:
    """The compact integer dtype of ``routed_experts`` for a model of ``num_experts`` experts:
    the smallest signed dtype holding the ids ``0 .. num_experts - 1`` and ``-1``.

    Raises:
        ValueError: ``num_experts`` < 1.
    """
    if num_experts < 1:
        raise ValueError(f"routed experts need a mixture-of-experts model, got num_experts={num_experts}")
    for dtype in (torch.int8, torch.int16, torch.int32):
        if num_experts - 1 <= torch.iinfo(dtype).max:
            return dtype
    raise ValueError(f"num_experts={num_experts} does not fit int32 expert ids")


def assemble_routed_experts(routes: Sequence[torch.Tensor], prompt_lengths: Sequence[int],
                            response_lengths: Sequence[int], *, prompt_len: int, response_len: int,
                            num_experts: int) -> torch.Tensor:
    """Place each sequence's routing at its token positions in the left-padded batch layout.

    Args:
        routes: per output row, ``[T_i, num_moe_layers, topk]`` integer expert ids of the
            sequence's first ``T_i`` tokens (prompt then response, unpadded), ``T_i <=
            prompt_lengths[i] + response_lengths[i]`` (the engine's routing of the tokens it fed;
            normally all but the last), :data:`NO_ROUTING` at a token it did not feed (a prompt
            token served from the prefix cache).
        prompt_lengths: real prompt tokens of each row (the prompt is left-padded to ``prompt_len``).
        response_lengths: generated tokens of each row (right-padded to ``response_len``).
        prompt_len, response_len: the batch's prompt and response widths.
        num_experts: the model's expert count (selects the dtype, bounds the ids).

    Returns:
        ``[rows, prompt_len + response_len, num_moe_layers, topk]`` in
        :func:`routed_experts_dtype`, :data:`NO_ROUTING` where no routing exists.

    Raises:
        ValueError: counts that disagree, a row with more routed tokens than tokens, layers or
            top-k that differ between rows, or an id outside ``0 .. num_experts - 1``.
    """
    if not len(routes) == len(prompt_lengths) == len(response_lengths):
        raise ValueError(f"{len(routes)} routings for {len(prompt_lengths)} prompts and "
                         f"{len(response_lengths)} responses")
    if not routes:
        raise ValueError("no routed experts to assemble")
    shape = tuple(routes[0].shape[1:])
    out = torch.full((len(routes), prompt_len + response_len, *shape), NO_ROUTING,
                     dtype=routed_experts_dtype(num_experts))
    for i, (route, p, r) in enumerate(zip(routes, prompt_lengths, response_lengths, strict=True)):
        if tuple(route.shape[1:]) != shape:
            raise ValueError(f"row {i}: routing of shape {tuple(route.shape)}, row 0 has [*, {shape}]")
        if route.shape[0] > p + r:
            raise ValueError(f"row {i}: routing for {route.shape[0]} tokens, but the sequence has {p} + {r}")
        if route.numel() and (route.min() < NO_ROUTING or route.max() >= num_experts):
            raise ValueError(f"row {i}: expert ids outside 0..{num_experts - 1} (or {NO_ROUTING}: not routed)")
        out[i, prompt_len - p:prompt_len - p + route.shape[0]] = route.to(out.dtype)
    return out


class HFRoutingCapture:
    """Records the experts a ``transformers`` MoE model routes every token to during ``generate``.

    A forward hook on each MoE block's router (``Qwen3MoeTopKRouter``: returns ``(logits,
    scores, indices)``, tokens flattened ``[batch * step_tokens]``) keeps the indices the model
    used; :meth:`routes` stitches the steps into ``[batch, steps_total, layers, topk]``
    (prefill then one position per decoding step), in the left-padded layout ``generate``
    works in.

    Args:
        model: a ``transformers`` causal LM whose decoder layers have ``mlp.gate`` routers.

    Raises:
        ValueError: the model has no MoE router.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        layers = getattr(getattr(model, "model", None), "layers", [])
        self.routers = [layer.mlp.gate for layer in layers if hasattr(getattr(layer, "mlp", None), "gate")]
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts router: routed experts need an "
                             "MoE model")
        self._steps: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._hooks: list = []

    def __enter__(self) -> HFRoutingCapture:
        self._steps = [[] for _ in self.routers]  # each generate records afresh
        for layer, router in enumerate(self.routers):
            self._hooks.append(router.register_forward_hook(
                lambda _m, _args, out, layer=layer: self._steps[layer].append(out[2].detach().cpu())))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def routes(self, batch: int) -> torch.Tensor:
        """``[batch, tokens fed, layers, topk]`` int64, the steps concatenated along tokens."""
        per_layer = [torch.cat([step.view(batch, -1, step.shape[-1]) for step in steps], dim=1)
                     for steps in self._steps]
        return torch.stack(per_layer, dim=2)


__all__ = ["NO_ROUTING", "routed_experts_dtype", "assemble_routed_experts", "HFRoutingCapture"]
