"""Calibrate ``rollout.verify_sync``'s bf16 tolerance (megaflow.rollout.verify_sync) on CPU.

SmolLM2-135M-Instruct (the project's real-model fixture) with its weights rounded to bf16
(or fp16); ``--prompts`` random sequences like the worker's probe prompts (token ids from 3
up to the vocabulary) of ``--length`` tokens. After every prefix of at least ``--min-prefix``
tokens (the probe's response follows prompts of 5 and 8 tokens), the log-prob of the greedy
token (the fp32 argmax: what the probe's greedy decoding emits) is computed by
``transformers`` twice on the same rounded weights: in fp32 (the reference) and in bf16
(logits in bf16, log-softmax in fp32, as vLLM and megaflow's trainer take it). One batched
forward per dtype, so it runs in minutes on a loaded CPU. Prints one JSON line: max / mean /
p99 of |Delta log p| and the tolerance they imply (twice the max: the engine's and the
trainer's gaps to the exact value add up at worst), rounded up to one significant digit.

    PYTHONPATH=$PWD .venv/bin/python tools/calibrate_verify_sync.py \\
        [--dtype bfloat16|float16] [--prompts 32] [--length 20]
"""
from __future__ import annotations

import argparse
import json

import torch


def _greedy_log_probs(model, ids: torch.Tensor, greedy: torch.Tensor | None = None):
    """Log-prob of the greedy token (argmax of the fp32 reference, or of ``model`` when
    ``greedy`` is None) after every prefix of ``ids`` ``[batch, seq]``; logits in the model's
    dtype, log-softmax in fp32."""
    with torch.no_grad():
        log_probs = torch.log_softmax(model(ids).logits.to(torch.float32), dim=-1)
    if greedy is None:
        greedy = log_probs.argmax(-1)
    return log_probs.gather(-1, greedy[..., None])[..., 0], greedy


def calibrate(model_dir: str, prompts: int, length: int, seed: int, dtype: torch.dtype,
              min_prefix: int = 5) -> dict:
    """|Delta log p| statistics of ``dtype`` vs fp32 compute on the same ``dtype`` weights (module docstring)."""
    from transformers import AutoModelForCausalLM

    from megaflow.rollout.verify_sync import round_up_one_digit

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stats = model_gap_statistics(reference, prompts, length, seed, dtype, min_prefix)
    stats["tolerance"] = round_up_one_digit(2 * stats["max"])
    return stats


def model_gap_statistics(reference, prompts: int, length: int, seed: int, dtype: torch.dtype,
                         min_prefix: int = 5) -> dict:
    """|Delta log p| statistics (max, mean, p99, tokens; nats) of ``dtype`` vs fp32 compute on
    the same ``dtype``-rounded weights of the HF causal LM ``reference`` (fp32, on any device;
    its weights are rounded in place and it is left in ``dtype``): ``prompts`` random probe
    sequences of ``length`` tokens, the greedy token after every prefix of >= ``min_prefix``."""
    from megaflow.rollout.verify_sync import gap_statistics

    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.to(dtype).to(torch.float32))
    device = next(reference.parameters()).device
    ids = torch.randint(3, reference.config.vocab_size, (prompts, length),
                        generator=torch.Generator().manual_seed(seed)).to(device)
    exact, greedy = _greedy_log_probs(reference, ids)
    low, _ = _greedy_log_probs(reference.to(dtype), ids, greedy)
    return gap_statistics((low - exact)[:, min_prefix - 1:].abs())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="HF model directory (default: the SmolLM2 fixture)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--length", type=int, default=20)
    parser.add_argument("--min-prefix", type=int, default=5,
                        help="shortest prefix measured (the worker's probe: prompts of 5 and 8 tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = parser.parse_args()
    if args.model_dir is None:
        from megaflow.models.smollm2 import ensure_smollm2

        args.model_dir = str(ensure_smollm2())
    stats = calibrate(args.model_dir, args.prompts, args.length, args.seed, getattr(torch, args.dtype),
                      args.min_prefix)
    print(json.dumps({"dtype": args.dtype, **stats}))


if __name__ == "__main__":
    main()
