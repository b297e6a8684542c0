"""Settings of the Megatron worker roles (typed, frozen, validated at construction)."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import torch

from megaflow.megatron.engine_config import EngineConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class ActorLossConfig:
    """Policy loss of ``update_actor`` (see :mod:`megaflow.algorithms`)."""

    policy_loss: str = "ppo"  # "ppo" or "gspo"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2  # > clip_ratio_low = DAPO clip-higher
    clip_ratio_c: Optional[float] = None  # dual clip constant (> 1), None = off
    loss_agg_mode: str = "token-mean"
    norm_length: Optional[int] = None  # seq-mean-token-sum-norm constant (max response length)
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False  # GRPO-style KL(pi || ref) loss term; needs ref_log_probs
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coeff != 0.0


@dataclasses.dataclass(frozen=True)
class CriticLossConfig:
    """Value loss of ``update_critic``."""

    cliprange_value: Optional[float] = 0.5
    loss_agg_mode: str = "token-mean"
    norm_length: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class MegatronWorkerConfig:
    """One Megatron role: model source, parallel layout, engine and loss settings.

    Exactly one of ``hf_config`` (random init from a config) and ``model_path`` (HF
    directory with ``config.json`` + safetensors) gives the architecture; ``checkpoint``
    (a megaflow checkpoint directory) overrides the weights.
    """

    model_path: Optional[str] = None
    hf_config: Optional[dict] = None
    checkpoint: Optional[str] = None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    vpp: Optional[int] = None
    dtype: str = "float32"
    seed: int = 1234
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    ppo_mini_batch_size: Optional[int] = None  # rows per optimizer step over all DP ranks; None = all
    ppo_epochs: int = 1
    temperature: float = 1.0  # rollout temperature when the batch's meta_info has none
    # What stays on the host between phases (each part reloaded only for the phase that uses it).
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    shuffle: bool = False  # permute a rank's rows before cutting them into mini-batches, each PPO epoch
    # megatron-core TransformerConfig knobs of the model build (scale features)
    sequence_parallel: bool = False
    recompute_granularity: Optional[str] = None  # None, "selective" or "full"
    recompute_method: Optional[str] = None  # "uniform" or "block" (full only)
    recompute_num_layers: Optional[int] = None  # full only
    actor: ActorLossConfig = dataclasses.field(default_factory=ActorLossConfig)
    critic: CriticLossConfig = dataclasses.field(default_factory=CriticLossConfig)

    def __post_init__(self) -> None:
        if (self.hf_config is None) == (self.model_path is None):
            raise ValueError("MegatronWorkerConfig needs exactly one of hf_config and model_path")
        if self.dtype not in _DTYPES:
            raise ValueError(f"MegatronWorkerConfig.dtype={self.dtype!r}; choose one of {sorted(_DTYPES)}")
        if self.ppo_epochs < 1:
            raise ValueError(f"MegatronWorkerConfig.ppo_epochs must be >= 1, got {self.ppo_epochs}")
        if self.ppo_mini_batch_size is not None and self.ppo_mini_batch_size < 1:
            raise ValueError(f"MegatronWorkerConfig.ppo_mini_batch_size must be >= 1, got "
                             f"{self.ppo_mini_batch_size}")
        if not self.temperature > 0:
            raise ValueError(f"MegatronWorkerConfig.temperature must be > 0, got {self.temperature}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def model_overrides(self) -> dict[str, Any]:
        """``TransformerConfig`` fields of the scale features (sequence parallelism,
        activation recomputation) for :func:`megaflow.megatron.model.build_gpt_model`."""
        out: dict[str, Any] = {"sequence_parallel": self.sequence_parallel and self.tp > 1}
        if self.recompute_granularity == "full":
            out.update(recompute_granularity="full", recompute_method=self.recompute_method or "uniform",
                       recompute_num_layers=self.recompute_num_layers or 1)
        elif self.recompute_granularity == "selective":
            out.update(recompute_granularity="selective")
        elif self.recompute_granularity is not None:
            raise ValueError(f"MegatronWorkerConfig.recompute_granularity={self.recompute_granularity!r}; "
                             f"choose None, 'selective' or 'full'")
        return out

    def resolve_hf_config(self) -> dict:
        """The HF config dict (``hf_config`` or ``model_path/config.json``).

        Raises:
            FileNotFoundError: ``model_path`` has no ``config.json``.
        """
        if self.hf_config is not None:
            return dict(self.hf_config)
        path = os.path.join(self.model_path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model_path {self.model_path!r} has no config.json")
        with open(path) as f:
            return json.load(f)

    def mini_batch_rows_per_rank(self, dp_size: int, rows_per_rank: int) -> int:
        """Rows of one mini-batch on one DP rank (``ppo_mini_batch_size / dp``).

        Raises:
            ValueError: ``ppo_mini_batch_size`` not divisible by ``dp_size``.
        """
        if self.ppo_mini_batch_size is None:
            return max(rows_per_rank, 1)
        if self.ppo_mini_batch_size % dp_size:
            raise ValueError(f"ppo_mini_batch_size={self.ppo_mini_batch_size} is not divisible by "
                             f"the data parallel size {dp_size}")
        return self.ppo_mini_batch_size // dp_size

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "MegatronWorkerConfig":
        """Build from plain nested dicts (``engine``, ``actor``, ``critic`` sub-dicts)."""
        values = dict(values)
        for key, sub in (("engine", EngineConfig), ("actor", ActorLossConfig), ("critic", CriticLossConfig)):
            if isinstance(values.get(key), dict):
                values[key] = sub(**values[key])
        return cls(**values)


__all__ = ["MegatronWorkerConfig", "ActorLossConfig", "CriticLossConfig"]
