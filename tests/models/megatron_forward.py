"""Test harness: full-vocabulary logits of a built megatron-core GPTModel on any TP/PP."""
from __future__ import annotations

import torch
import torch.distributed as dist


def megatron_logits(model, input_ids: torch.Tensor, info, vocab_size: int) -> torch.Tensor | None:
    """Logits ``[batch, seq, vocab_size]`` on the last stage (padding dropped), None elsewhere.

    Causal mask passed explicitly; stage-to-stage hand-off by plain send/recv (a test
    harness, not the training schedule); vocab-parallel logits all-gathered over TP.
    """
    b, s = input_ids.shape
    position_ids = torch.arange(s).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None].expand(b, 1, s, s)
    with torch.no_grad():
        if info.pp_size > 1 and info.pp_rank > 0:
            hidden = torch.empty(s, b, model.config.hidden_size)
            dist.recv(hidden, src=info.pp_ranks[info.pp_rank - 1])
            model.set_input_tensor(hidden)
        out = model(input_ids, position_ids, mask)
        if not info.is_last_pp_stage:
            dist.send(out.contiguous(), dst=info.pp_ranks[info.pp_rank + 1])
            return None
        if info.tp_size > 1:
            parts = [torch.empty_like(out) for _ in range(info.tp_size)]
            dist.all_gather(parts, out.contiguous(), group=info.tp_group)
            out = torch.cat(parts, dim=-1)
    return out[..., :vocab_size].clone()
