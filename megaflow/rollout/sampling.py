"""Sampling parameters of one rollout call, read from a ``DataProto``'s ``meta_info``.

A rollout engine holds a default :class:`SamplingConfig` (from its own config); every
``generate_sequences`` call may override any field through ``meta_info`` keys of the
same name, so the controller can switch between training rollouts (sampling, ``n``
samples per prompt) and validation (greedy) without rebuilding the engine.

Recognised ``meta_info`` keys (all optional; other keys are ignored):

=================== ============= ===============================================
key                 type          meaning
=================== ============= ===============================================
``n``               int >= 1      samples per prompt (rows come out interleaved)
``do_sample``       bool          ``False`` -> greedy (temperature 0)
``temperature``     float >= 0    softmax temperature; 0 means greedy
``top_p``           0 < p <= 1    nucleus sampling mass (1 = off)
``top_k``           int           top-k sampling (-1 or 0 = off)
``response_length`` int >= 1      max new tokens; responses are padded to it
``max_tokens``      int >= 1      alias of ``response_length`` (vLLM's name)
``eos_token_id``    int or list   ids that end a response (kept in the response)
``pad_token_id``    int           id written after the end of each response
``seed``            int           base seed; same seed + same prompts = same samples
=================== ============= ===============================================
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

META_KEYS: tuple[str, ...] = ("n", "do_sample", "temperature", "top_p", "top_k", "response_length",
                              "max_tokens", "eos_token_id", "pad_token_id", "seed")


def _as_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"sampling parameter {key!r} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def _as_float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"sampling parameter {key!r} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


def _as_token_ids(key: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return (int(value),)
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return tuple(_as_int(key, v) for v in value)
    raise TypeError(f"sampling parameter {key!r} must be an int or a list of ints, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Sampling parameters of a rollout (see the module docstring for the meta_info keys).

    Attributes:
        n: samples per prompt.
        do_sample: ``False`` selects greedy decoding whatever the temperature.
        temperature: softmax temperature (``0`` = greedy).
        top_p: nucleus mass in ``(0, 1]``; ``1`` disables it.
        top_k: keep the ``top_k`` most likely tokens; ``-1`` (or ``0``) disables it. Both
            with vLLM's semantics (temperature, then top-k, then top-p on the survivors;
            :func:`megaflow.megatron.logprobs.truncation_mask`, which the trainer applies
            to its own logits for processed log-probs).
        response_length: maximum number of new tokens; the output's response dimension.
        eos_token_ids: token ids that end a response; may be empty (run to the length limit).
        pad_token_id: id used to right-pad responses (may equal an EOS id).
        seed: base seed of the per-request seeds; ``None`` lets the engine derive one
            from its own seed and a call counter (still identical on all TP ranks).

    Raises:
        ValueError / TypeError: an out-of-range or mistyped field, naming it.
    """

    n: int = 1
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    response_length: int = 64
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if _as_int("n", self.n) < 1:
            raise ValueError(f"sampling parameter 'n' must be >= 1, got {self.n}")
        if not isinstance(self.do_sample, (bool, np.bool_)):
            raise TypeError(f"sampling parameter 'do_sample' must be a bool, got {self.do_sample!r}")
        if _as_float("temperature", self.temperature) < 0:
            raise ValueError(f"sampling parameter 'temperature' must be >= 0, got {self.temperature}")
        if not 0.0 < _as_float("top_p", self.top_p) <= 1.0:
            raise ValueError(f"sampling parameter 'top_p' must be in (0, 1], got {self.top_p}")
        if _as_int("top_k", self.top_k) < -1:
            raise ValueError(f"sampling parameter 'top_k' must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        if _as_int("response_length", self.response_length) < 1:
            raise ValueError(f"sampling parameter 'response_length' must be >= 1, got {self.response_length}")
        object.__setattr__(self, "eos_token_ids", _as_token_ids("eos_token_id", self.eos_token_ids))
        if any(t < 0 for t in self.eos_token_ids):
            raise ValueError(f"sampling parameter 'eos_token_id' must be non-negative ids, got {self.eos_token_ids}")
        if _as_int("pad_token_id", self.pad_token_id) < 0:
            raise ValueError(f"sampling parameter 'pad_token_id' must be >= 0, got {self.pad_token_id}")
        if self.seed is not None:
            _as_int("seed", self.seed)

    @classmethod
    def from_pretrained(cls, model_path: str, **overrides: Any) -> SamplingConfig:
        """Defaults with the EOS and pad ids of a Hugging Face model directory.

        EOS ids come from ``generation_config.json`` when it names them, else from
        ``config.json``; the pad id likewise, falling back to the first EOS id, then 0.
        ``overrides`` are field values that win over both.

        Raises:
            FileNotFoundError: no ``config.json`` in ``model_path``.
        """
        found: dict[str, Any] = {}
        for filename in ("config.json", "generation_config.json"):  # later files win
            path = os.path.join(model_path, filename)
            if not os.path.isfile(path):
                if filename == "config.json":
                    raise FileNotFoundError(f"no config.json in model directory {model_path!r}")
                continue
            with open(path) as f:
                data = json.load(f)
            found.update({k: data[k] for k in ("eos_token_id", "pad_token_id") if data.get(k) is not None})
        eos = _as_token_ids("eos_token_id", found["eos_token_id"]) if "eos_token_id" in found else ()
        pad = found.get("pad_token_id", eos[0] if eos else 0)
        return cls(**{"eos_token_ids": eos, "pad_token_id": pad, **overrides})

    @property
    def greedy(self) -> bool:
        """True when decoding is greedy (``do_sample=False`` or ``temperature == 0``)."""
        return (not self.do_sample) or self.temperature == 0.0

    def override(self, meta_info: Mapping[str, Any]) -> SamplingConfig:
        """A copy with the recognised ``meta_info`` keys applied (others are ignored).

        Raises:
            ValueError: ``response_length`` and ``max_tokens`` both given and different,
                or an overridden value is out of range (the key is named).
            TypeError: a mistyped value (the key is named).
        """
        changes: dict[str, Any] = {}
        for key in ("n", "do_sample", "temperature", "top_p", "top_k", "pad_token_id", "seed"):
            if key in meta_info:
                changes[key] = meta_info[key]
        lengths = {k: meta_info[k] for k in ("response_length", "max_tokens") if k in meta_info}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"meta_info gives different 'response_length' and 'max_tokens': {lengths}")
        if lengths:
            changes["response_length"] = next(iter(lengths.values()))
        if "eos_token_id" in meta_info:
            changes["eos_token_ids"] = meta_info["eos_token_id"]
        return dataclasses.replace(self, **changes) if changes else self


def request_seeds(base_seed: int, num_requests: int, *, stream: int = 0) -> list[int]:
    """Independent 63-bit seeds for ``num_requests`` requests, a pure function of the inputs.

    Every rank of one tensor-parallel group computes the same list (the inputs are the
    same), so every rank samples the same tokens. Request ``i`` of a call is row ``i``
    of the flattened ``[batch * n]`` output.

    Args:
        base_seed: the call's seed (``SamplingConfig.seed`` or an engine-derived one).
        num_requests: number of seeds.
        stream: an extra integer mixed into the seed (the engine's call counter when no
            explicit seed is given).

    Returns:
        ``num_requests`` non-negative ints below ``2**63``.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    entropy = [int(base_seed) & 0xFFFFFFFFFFFFFFFF, int(stream) & 0xFFFFFFFFFFFFFFFF]
    state = np.random.SeedSequence(entropy).generate_state(num_requests, dtype=np.uint64)
    return [int(s) >> 1 for s in state]


__all__ = ["SamplingConfig", "request_seeds", "META_KEYS"]
