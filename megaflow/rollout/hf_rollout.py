"""Reference rollout on Hugging Face ``transformers`` ``generate`` (tests and baselines only).

Same ``generate_sequences(DataProto) -> DataProto`` contract as
:class:`megaflow.rollout.vllm_rollout.VLLMRollout`, computed the plain way: the prompts
repeated ``n`` times (interleaved), one ``model.generate`` call with a KV cache, the
per-step scores turned into log-probs of the sampled tokens. It is the oracle that the
vLLM engine is tested against (greedy tokens, log-probs) and the baseline of
``tools/bench_rollout.py``; it is single-process and not tensor parallel, so it is not a
production path.

Log-probs: ``generate``'s ``scores`` are the logits after its logits processors
(temperature, top-k, top-p), so ``log_softmax(scores)`` at the sampled token is the same
quantity as vLLM's ``processed_logprobs``: ``log_softmax(logits / temperature)`` when
top-k/top-p are off, and ``log_softmax(logits)`` for greedy decoding. Response masks are
built by position from the first EOS (:func:`megaflow.algorithms.response_mask.compute_response_mask`).
Sampling uses torch's global generator seeded from the call's seed inside a forked RNG
scope, so it is reproducible for a given seed but draws different samples than vLLM.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from megaflow.algorithms.response_mask import compute_response_mask
from megaflow.protocol import DataProto
from megaflow.rollout.batch import assemble_rollout_batch, check_left_padded, read_prompts, rollout_output
from megaflow.rollout.routing import HFRoutingCapture, assemble_routed_experts
from megaflow.rollout.sampling import SamplingConfig, request_seeds

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class HFRollout:
    """Rollouts with ``transformers`` ``generate`` on one process.

    Args:
        model: a causal LM (``PreTrainedModel``) in eval mode, on its device.
        sampling: default sampling parameters (``meta_info`` overrides per call); ``None``
            takes EOS/pad ids from ``model.generation_config`` / ``model.config``.
        seed: base seed used when a call's ``meta_info`` gives none.
        return_routed_experts: also return ``routed_experts`` (:mod:`megaflow.rollout.routing`),
            the experts the model's routers chose for every token ``generate`` fed (recorded
            during generation, not recomputed).

    Raises:
        ValueError: ``return_routed_experts`` with a model without MoE routers.
    """

    def __init__(self, model: PreTrainedModel, sampling: SamplingConfig | None = None, *, seed: int = 0,
                 return_routed_experts: bool = False) -> None:
        self.model = model.eval()
        self.sampling = sampling if sampling is not None else _sampling_from_model(model)
        self.seed = seed
        self._num_calls = 0
        self._routing = HFRoutingCapture(model) if return_routed_experts else None

    @classmethod
    def from_pretrained(cls, model_path: str, *, dtype: torch.dtype = torch.float32,
                        sampling: SamplingConfig | None = None, seed: int = 0) -> HFRollout:
        """Load ``AutoModelForCausalLM`` from ``model_path`` in ``dtype``."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        return cls(model, sampling if sampling is not None else SamplingConfig.from_pretrained(model_path),
                   seed=seed)

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Same contract as :meth:`VLLMRollout.generate_sequences` (fields, order, errors)."""
        input_ids, attention_mask = read_prompts(prompts)
        sampling = self.sampling.override(prompts.meta_info)
        check_left_padded(input_ids, attention_mask)
        n, device = sampling.n, next(self.model.parameters()).device
        ids = input_ids.repeat_interleave(n, dim=0).to(device)
        mask = attention_mask.repeat_interleave(n, dim=0).to(device)
        seed = request_seeds(self.seed if sampling.seed is None else sampling.seed, 1,
                             stream=self._num_calls + 1 if sampling.seed is None else 0)[0]
        self._num_calls += 1
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                self._routing if self._routing is not None else contextlib.nullcontext():
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids, attention_mask=mask,
                                      generation_config=_generation_config(sampling))
        generated = out.sequences[:, input_ids.shape[1]:].cpu()
        scores = torch.stack(out.scores, dim=1).float().cpu()  # [batch*n, steps, vocab]
        log_probs = torch.log_softmax(scores, dim=-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        if sampling.eos_token_ids:
            lengths = compute_response_mask(generated, list(sampling.eos_token_ids)).sum(dim=-1).tolist()
        else:
            lengths = [generated.shape[1]] * generated.shape[0]
        responses = [generated[i, :k].tolist() for i, k in enumerate(lengths)]
        response_log_probs = [log_probs[i, :k].tolist() for i, k in enumerate(lengths)]
        tensors = assemble_rollout_batch(input_ids, attention_mask, responses, response_log_probs, n=n,
                                         response_length=sampling.response_length,
                                         pad_token_id=sampling.pad_token_id)
        if self._routing is not None:
            tensors["routed_experts"] = self._routed_experts(mask.cpu(), lengths, sampling.response_length)
        return rollout_output(prompts, tensors, n)

    def _routed_experts(self, mask: torch.Tensor, lengths: list[int], response_length: int) -> torch.Tensor:
        """The recorded routing in the batch layout: ``generate`` fed the left-padded prompts,
        then one generated token per step, so column ``j`` of its steps is column ``j`` of
        ``input_ids``; kept for the real prompt tokens and all but the last response token."""
        assert self._routing is not None
        prompt_len = mask.shape[1]
        routes = self._routing.routes(mask.shape[0])
        prompt_lengths = mask.sum(dim=-1).tolist()
        rows = [routes[i, prompt_len - p:prompt_len + max(r - 1, 0)]
                for i, (p, r) in enumerate(zip(prompt_lengths, lengths, strict=True))]
        return assemble_routed_experts(rows, prompt_lengths, lengths, prompt_len=prompt_len,
                                       response_len=response_length, num_experts=self.model.config.num_experts)


def _generation_config(sampling: SamplingConfig):
    """An explicit ``GenerationConfig``. ``generate`` fills fields left ``None`` from the
    model's own generation config, so "no EOS" is an empty list, not ``None``."""
    from transformers import GenerationConfig

    eos = list(sampling.eos_token_ids)
    kwargs = dict(max_new_tokens=sampling.response_length, min_new_tokens=0, eos_token_id=eos,
                  pad_token_id=sampling.pad_token_id, num_beams=1, use_cache=True,
                  return_dict_in_generate=True, output_scores=True)
    if sampling.greedy:
        return GenerationConfig(do_sample=False, **kwargs)
    return GenerationConfig(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                            top_k=max(sampling.top_k, 0), **kwargs)


def _sampling_from_model(model: torch.nn.Module) -> SamplingConfig:
    """EOS/pad ids from the model's generation config, falling back to its config."""
    sources = [getattr(model, "generation_config", None), getattr(model, "config", None)]
    eos = next((s.eos_token_id for s in sources if s is not None and s.eos_token_id is not None), None)
    eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    pad = next((s.pad_token_id for s in sources if s is not None and getattr(s, "pad_token_id", None) is not None),
               eos_ids[0] if eos_ids else 0)
    return SamplingConfig(eos_token_ids=eos_ids, pad_token_id=pad)


__all__ = ["HFRollout"]
