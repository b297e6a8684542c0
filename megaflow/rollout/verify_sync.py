"""``rollout.verify_sync``'s tolerance: the largest |engine - trainer| log-prob gap on the probe, by dtype.

After a weight sync the engine and the trainer hold the same weights, so their log-probs of
the engine's greedy probe tokens differ only by their kernels' rounding: the order of the
reductions, fused versus unfused softmax, where each implementation rounds activations to
the compute dtype. In fp32 that is below 1e-5 for megaflow's models (the tolerance used so
far). In bf16 (8 bits of mantissa, a relative rounding of 2^-9 = 0.2 %) it is a few
hundredths of a nat, so a fp32 tolerance fails every bf16 sync.

Calibration of the bf16 tolerance (``tools/calibrate_verify_sync.py``, recorded in
:data:`BF16_CALIBRATION`; fp16 likewise in :data:`FP16_CALIBRATION`): SmolLM2-135M-Instruct
with its weights rounded to bf16, 32 random probe sequences of 20 tokens (ids from 3 up to
the vocabulary, as the worker's probe prompts); after each of the 512 prefixes of 5 or more
tokens (the probe's responses follow prompts of 5 and 8 tokens) the log-prob of the greedy
token, computed by ``transformers`` in bf16 (log-softmax in fp32) and in fp32
on the same bf16 weights. The fp32 result stands for the exact value of those weights, so
the engine's gap to the trainer is at most the sum of their two gaps to it (triangle
inequality): twice the largest bf16-vs-fp32 gap, rounded up to one digit, is
:data:`VERIFY_SYNC_ATOL` ``["bfloat16"]``. A stale or misplaced shard moves log-probs by
whole nats, far above it; a one-step-stale engine may stay below it in bf16 (the version
counters catch that case on every step). Prefixes of 1-4 random tokens are left out: there
SmolLM2's bf16 and fp32 results can part by whole nats (11.6 on one of 32 two-token
prefixes), which no probe response meets. This is a CPU stand-in for CUDA vLLM and Megatron's kernels: the
device run of ``tools/gpu_smoke.py`` should measure their gap and replace it.
"""
from __future__ import annotations

import math

import torch

#: |Delta log p| statistics (nats) of the bf16 calibration (module docstring): bf16 vs fp32
#: compute on the same bf16 weights, 512 greedy probe tokens.
BF16_CALIBRATION = {"max": 0.3308, "mean": 0.0497, "p99": 0.2394, "tokens": 512}
#: The same with fp16 weights and compute.
FP16_CALIBRATION = {"max": 0.0326, "mean": 0.0062, "p99": 0.0249, "tokens": 512}


def round_up_one_digit(x: float) -> float:
    """``x > 0`` rounded up to one significant digit (0.0123 -> 0.02)."""
    exponent = math.floor(math.log10(x))
    return round(math.ceil(round(x / 10 ** exponent, 9)) * 10 ** exponent, -exponent)


#: Largest accepted |engine - trainer| log-prob gap on the probe, by ``model.dtype``: fp32 as
#: measured by the CPU tests; bf16 and fp16 twice their calibration's largest gap, rounded up.
VERIFY_SYNC_ATOL: dict[str, float] = {
    "float32": 1e-5,
    "bfloat16": round_up_one_digit(2 * BF16_CALIBRATION["max"]),
    "float16": round_up_one_digit(2 * FP16_CALIBRATION["max"]),
}


def verify_sync_tolerance(dtype: str) -> float:
    """The probe's tolerance for engines and trainers computing in ``dtype`` (``model.dtype``).

    Raises:
        ValueError: a dtype without a calibrated tolerance.
    """
    if dtype not in VERIFY_SYNC_ATOL:
        raise ValueError(f"rollout.verify_sync has no tolerance for model.dtype={dtype!r}; "
                         f"calibrated: {sorted(VERIFY_SYNC_ATOL)}")
    return VERIFY_SYNC_ATOL[dtype]


def gap_statistics(gaps: torch.Tensor) -> dict[str, float]:
    """max, mean and 99th percentile of ``gaps`` (|Delta log p| of the probe's tokens, any shape)."""
    flat = gaps.detach().reshape(-1).to(torch.float64)
    return {"max": float(flat.max()), "mean": float(flat.mean()), "p99": float(torch.quantile(flat, 0.99)),
            "tokens": int(flat.numel())}


__all__ = ["BF16_CALIBRATION", "FP16_CALIBRATION", "VERIFY_SYNC_ATOL", "gap_statistics", "round_up_one_digit",
           "verify_sync_tolerance"]
