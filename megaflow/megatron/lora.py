"""Tensor-parallel LoRA adapters on megatron-core's parallel linears (Hu et al. 2021, "LoRA:
Low-Rank Adaptation of Large Language Models", eq. 3).

megatron-core 0.16.1 has no LoRA module. :func:`apply_lora` turns a targeted
``ColumnParallelLinear`` (``linear_qkv``, ``linear_fc1``) or ``RowParallelLinear``
(``linear_proj``, ``linear_fc2``) of a built ``GPTModel`` into an adapted layer computing

    y = W x + s * B A dropout(x),   s = alpha / rank,

with ``A`` ``[rank, in]`` (Kaiming-uniform like PEFT: ``U(-1/sqrt(in), 1/sqrt(in))``, drawn
from a generator seeded by the run's seed and the layer's global name, so every TP / PP
layout draws the same full matrix) and ``B`` ``[out, rank]`` initialised to zero. The
layer object is kept (its class is swapped for a subclass), so the base parameter names
(``P.weight``, ``P.bias``) do not change; the adapters are ``P.lora_a.weight`` and
``P.lora_b.weight``.

Tensor parallelism (``t`` ranks; ``x`` the layer input, ``dy`` the output gradient):

* **Column-parallel** (output split): rank ``i`` holds ``W_i`` ``[out/t, in]`` and sees the
  full, replicated ``x``. ``A`` is replicated and ``B`` split like ``W`` on dim 0 (``B_i``
  ``[out/t, r]``, the rows of ``W_i`` in Megatron's order: QKV interleaved per query group,
  fc1 ``[gate; up]`` per shard), so ``y_i = W_i x + s B_i (A x)`` is exactly rank ``i``'s
  output slice. Backward: ``dL/d(Ax) = s sum_i B_i^T dy_i`` is a sum over TP ranks, so the
  rank-``r`` activation ``h = A x`` passes through ``copy_to_tensor_model_parallel_region``
  (identity forward, all-reduce of the ``[tokens, r]`` gradient backward) before ``B_i``;
  then ``dA = dL/dh x^T`` is complete and equal on every rank (a replicated parameter), and
  the adapter's input gradient ``A^T dL/dh`` is complete too (it adds to the base's, which
  the base layer all-reduces itself).
* **Row-parallel** (input split): rank ``i`` holds ``W_i`` ``[out, in/t]`` and its input
  slice ``x_i``; ``A`` is split like ``W`` on dim 1 (``A_i`` ``[r, in/t]``) and ``B``
  replicated: ``A x = sum_i A_i x_i``, so the partial ``A_i x_i`` is all-reduced with
  ``reduce_from_tensor_model_parallel_region`` (all-reduce of ``[tokens, r]`` forward,
  identity backward) before the replicated ``B``. Backward: ``dL/dh = s B^T dy`` is the same on
  every rank (``dy`` is replicated), so ``dA_i = dL/dh x_i^T`` and ``dB = s dy h^T`` need no
  further communication.

Replicated adapter parameters carry ``tensor_model_parallel=False`` (Megatron counts them once
in the gradient norm), split ones ``tensor_model_parallel=True`` with ``partition_dim`` 0
(column ``B``) or 1 (row ``A``) and ``partition_stride=1``, as megatron-core sets them on the
base weights; the layer's ``sharded_state_dict`` shards them the same way in checkpoints.

Dropout (``p``) acts on the adapter's input only and only in training mode. For a
column-parallel layer it draws from the default RNG, identical on the ranks of a TP group
(Megatron seeds them equally), so the replicated ``A dropout(x)`` agrees across them; for a
row-parallel layer it draws inside Megatron's model-parallel RNG tracker (a different stream
per TP rank on CUDA), each rank masking its own input slice.

Not supported (refused with an error): sequence parallelism and Transformer Engine's
norm-fused column-parallel linears (the adapter would see the input before the norm); the
workers build LoRA models with megatron-core's local layer spec.

The base is frozen by :func:`apply_lora` (``requires_grad=False``: Megatron DDP allocates no
gradient buffer for it and the optimizer, built over the parameters that require gradients,
holds no state for it); ``keep_trainable`` names parameters that stay trained in full (the
critic's freshly initialised value head).
"""
from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

#: Megatron linears LoRA can target: the column-parallel ones (output split over TP) ...
COLUMN_TARGETS = ("linear_qkv", "linear_fc1")
#: ... and the row-parallel ones (input split over TP).
ROW_TARGETS = ("linear_proj", "linear_fc2")
LORA_TARGETS = COLUMN_TARGETS + ROW_TARGETS
#: Name parts of the adapter parameters (``P.lora_a.weight``, ``P.lora_b.weight``).
ADAPTER_PARTS = ("lora_a", "lora_b")
_ADAPTER_NAME = re.compile(r"(^|\.)lora_[ab]\.weight$")
_LAYER_PATH = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class LoRASettings:
    """What :func:`apply_lora` builds: ``rank`` (> 0), ``alpha`` (> 0), ``dropout`` in [0, 1), the
    targeted module names (subset of :data:`LORA_TARGETS`) and the initialisation ``seed``."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LORA_TARGETS
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise ValueError(f"LoRA rank must be > 0, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must lie in [0, 1), got {self.dropout}")
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        if unknown or not self.target_modules:
            raise ValueError(f"LoRA target_modules must be a non-empty subset of {LORA_TARGETS}, "
                             f"got {tuple(self.target_modules)}")

    @property
    def scale(self) -> float:
        """``s = alpha / rank`` (Hu et al. 2021, section 4.1)."""
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, section: Any, seed: int) -> LoRASettings | None:
        """From a ``<role>.lora`` config section; None when ``rank`` is 0 (LoRA off)."""
        if section is None or section.rank == 0:
            return None
        return cls(rank=section.rank, alpha=section.alpha, dropout=section.dropout,
                   target_modules=tuple(section.target_modules), seed=seed)


class LoRALayerMixin:
    """The adapter half of a LoRA layer; combined with the base layer's class by
    :func:`apply_lora` (``LoRA<Base>``). Attributes: ``lora_a``, ``lora_b`` (``nn.Linear``
    without bias), ``lora_dropout``, ``lora_scale`` (``alpha / rank``), ``lora_kind``
    (``"column"`` or ``"row"``), ``lora_enabled`` (False: the base layer alone) and
    ``lora_swiglu`` (a gated fc1: B's rows are ``[gate_i; up_i]`` per TP shard)."""

    lora_a: torch.nn.Linear
    lora_b: torch.nn.Linear
    lora_dropout: torch.nn.Module
    lora_scale: float
    lora_kind: str
    lora_enabled: bool
    lora_swiglu: bool

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any):
        output, bias = super().forward(input_, *args, **kwargs)  # type: ignore[misc]
        if self.lora_enabled:
            output = output + self.lora_delta(input_)
        return output, bias

    def lora_delta(self, input_: torch.Tensor) -> torch.Tensor:
        """``s * B A dropout(x)`` for this rank's output: ``[s, b, out/t]`` (column) or the full
        ``[s, b, out]`` (row) from the layer input ``[s, b, in]`` / ``[s, b, in/t]``."""
        from megatron.core import tensor_parallel

        group = self.tp_group  # type: ignore[attr-defined]
        if self.lora_kind == "column":
            hidden = F.linear(self.lora_dropout(input_), self.lora_a.weight)
            hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=group)
        else:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                dropped = self.lora_dropout(input_)
            hidden = tensor_parallel.reduce_from_tensor_model_parallel_region(
                F.linear(dropped, self.lora_a.weight), group=group)
        return F.linear(hidden, self.lora_b.weight) * self.lora_scale

    def merged_weight(self) -> torch.Tensor:
        """This rank's ``W + s * B A`` shard (a new tensor, laid out like ``weight``): the
        column layer's ``B_i A`` and the row layer's ``B A_i`` are exactly the local shards of
        the full ``B A``, so merging needs no communication."""
        weight = self.weight  # type: ignore[attr-defined]
        with torch.no_grad():
            delta = self.lora_b.weight.float() @ self.lora_a.weight.float()
            return (weight.float() + self.lora_scale * delta).to(weight.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The base layer's checkpoint shards plus the adapters, sharded as their TP attributes say."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = {"weight": 0, "bias": 0, "lora_b.weight": 0} if self.lora_kind == "column" \
            else {"weight": 1, "lora_a.weight": 1}
        sharded = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axes, sharded_offsets,  # type: ignore[attr-defined]
            tp_group=self.tp_group, dp_cp_group=(metadata or {})["dp_cp_group"])  # type: ignore[attr-defined]
        if self.lora_swiglu:  # B's rows are [gate_i; up_i] per TP shard, like fc1's weight (megatron-core's MLP)
            key = f"{prefix}lora_b.weight"
            sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets,
                                                        (metadata or {}).get("singleton_local_shards", False))
        return sharded


_LORA_CLASSES: dict[type, type] = {}


def _lora_class(base: type) -> type:
    if base not in _LORA_CLASSES:
        _LORA_CLASSES[base] = type(f"LoRA{base.__name__}", (LoRALayerMixin, base), {})
    return _LORA_CLASSES[base]


def _layer_kind(path: str, layer: torch.nn.Module) -> str:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    name = path.rsplit(".", 1)[-1]
    if "layer_norm_weight" in dict(layer.named_parameters(recurse=False)):
        raise NotImplementedError(f"{path}: LoRA on a norm-fused linear ({type(layer).__name__}) is not supported; "
                                  "build the model with megatron-core's local layer spec")
    if getattr(layer, "sequence_parallel", False):
        raise NotImplementedError(f"{path}: LoRA with sequence parallelism is not supported")
    if name in COLUMN_TARGETS and isinstance(layer, ColumnParallelLinear) and not layer.gather_output:
        return "column"
    if name in ROW_TARGETS and isinstance(layer, RowParallelLinear) and layer.input_is_parallel:
        return "row"
    raise NotImplementedError(f"{path}: LoRA supports megatron-core's Column/RowParallelLinear as "
                              f"{LORA_TARGETS}, got {type(layer).__name__}")


def global_module_path(model: Any, path: str) -> str:
    """``decoder.layers.{i}.X`` (stage-local ``i``) -> the global layer number's path (megatron's
    ``layer_number`` is 1-based and global); other paths unchanged."""
    match = _LAYER_PATH.match(path)
    if not match:
        return path
    layer = model.decoder.layers[int(match.group(1))]
    return f"decoder.layers.{layer.layer_number - 1}.{match.group(2)}"


def _kaiming_uniform_a(rank: int, in_features: int, seed: int, name: str) -> torch.Tensor:
    """The full ``A`` ``[rank, in_features]``: PEFT's ``kaiming_uniform_(a=sqrt(5))``, i.e.
    ``U(-1/sqrt(in), 1/sqrt(in))``, from a generator seeded by ``seed`` and ``name``."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank, in_features, generator=generator, dtype=torch.float64) * 2 - 1) * bound


def _adapter(weight: torch.Tensor, *, parallel: bool, dim: int) -> torch.nn.Linear:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    out_f, in_f = weight.shape
    linear = torch.nn.Linear(in_f, out_f, bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight)
    set_tensor_model_parallel_attributes(linear.weight, parallel, dim if parallel else -1, 1)
    linear.weight.sequence_parallel = False  # type: ignore[attr-defined]
    return linear


def _attach(layer: Any, kind: str, settings: LoRASettings, global_path: str) -> None:
    """Add ``lora_a``/``lora_b`` to ``layer`` (this rank's shards) and swap its class."""
    weight = layer.weight
    out_local, in_local = weight.shape
    tp, tp_rank = layer.tp_group.size(), layer.tp_group.rank()
    in_full = in_local * tp if kind == "row" else in_local
    full_a = _kaiming_uniform_a(settings.rank, in_full, settings.seed, global_path)
    if kind == "row":
        full_a = full_a[:, tp_rank * in_local:(tp_rank + 1) * in_local]
    a = full_a.to(device=weight.device, dtype=weight.dtype).contiguous()
    b = torch.zeros(out_local, settings.rank, device=weight.device, dtype=weight.dtype)
    layer.lora_a = _adapter(a, parallel=kind == "row", dim=1)
    layer.lora_b = _adapter(b, parallel=kind == "column", dim=0)
    layer.lora_dropout = torch.nn.Dropout(settings.dropout) if settings.dropout > 0 else torch.nn.Identity()
    layer.lora_scale, layer.lora_kind, layer.lora_enabled = settings.scale, kind, True
    layer.lora_swiglu = global_path.endswith("linear_fc1") and bool(layer.config.gated_linear_unit)
    layer.__class__ = _lora_class(type(layer))


def apply_lora(model: torch.nn.Module, settings: LoRASettings, *,
               keep_trainable: Sequence[str] = ()) -> list[str]:
    """Add LoRA adapters to every targeted linear of ``model`` and freeze the rest.

    Call on the unwrapped ``GPTModel`` (this rank's TP shard / PP stage) after its weights are
    loaded and before Megatron DDP and the optimizer are built over it.

    Args:
        model: this rank's ``GPTModel``.
        settings: rank, alpha, dropout, targets and seed.
        keep_trainable: parameter names (``model.named_parameters()``) that stay trainable in
            full besides the adapters, e.g. ``("output_layer.weight",)`` for a critic's value head.

    Returns:
        The adapted module paths (stage-local layer numbers), in model order.

    Raises:
        NotImplementedError: a targeted module that is not a plain megatron-core Column/Row
            parallel linear (a norm-fused TE linear, a gathered output), or sequence parallelism.
        ValueError: no module matched the targets (e.g. a stage without layers is fine: only
            when the model has layers), a ``keep_trainable`` name the model lacks, or ``model``
            already holds adapters.
    """
    if any(isinstance(m, LoRALayerMixin) for m in model.modules()):
        raise ValueError("apply_lora: the model already holds LoRA adapters")
    params = dict(model.named_parameters())
    missing = sorted(set(keep_trainable) - set(params))
    if missing:
        raise ValueError(f"apply_lora: keep_trainable names {missing} are not parameters of the model")
    targets = [(path, module) for path, module in model.named_modules()
               if path.rsplit(".", 1)[-1] in settings.target_modules and ".mlp.experts." not in path]
    has_layers = any(_LAYER_PATH.match(n) for n in params)
    if has_layers and not targets:
        raise ValueError(f"apply_lora: no module named {settings.target_modules} in the model")
    kinds = [(path, module, _layer_kind(path, module)) for path, module in targets]
    for param in model.parameters():
        param.requires_grad = False
    for path, module, kind in kinds:
        _attach(module, kind, settings, global_module_path(model, path))
    for name, param in model.named_parameters():
        param.requires_grad = is_adapter_name(name) or name in keep_trainable
    return [path for path, _, _ in kinds]


def is_adapter_name(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (``...lora_a.weight`` / ``...lora_b.weight``)."""
    return bool(_ADAPTER_NAME.search(name))


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, LoRALayerMixin]]:
    """``(module path, layer)`` of every adapted layer of ``model`` (wrapper prefixes kept)."""
    for path, module in model.named_modules():
        if isinstance(module, LoRALayerMixin):
            yield path, module


def has_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds LoRA adapters."""
    return next(lora_layers(model), None) is not None


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``{name: parameter}`` of the adapters (``P.lora_a.weight``, ``P.lora_b.weight``; this
    rank's shards, stage-local layer numbers, wrapper prefixes kept), in model order."""
    return {name: p for name, p in model.named_parameters() if is_adapter_name(name)}


def weight_sync_sources(model: torch.nn.Module
                        ) -> tuple[dict[str, torch.Tensor], dict[str, Callable[[], torch.Tensor]]]:
    """What the merged weight sync reads from ``model``: ``(base parameters, merged)``.

    ``base parameters``: ``{name: parameter}`` without the adapters (the names an LoRA-free
    model has); ``merged``: for every adapted weight ``P.weight`` a function returning this
    rank's ``W + s * B A`` shard (:meth:`LoRALayerMixin.merged_weight`), computed when called,
    one tensor at a time. ``merged`` is empty for a model without adapters.
    """
    base: dict[str, torch.Tensor] = {name: p for name, p in model.named_parameters() if not is_adapter_name(name)}
    merged = {f"{path}.weight": layer.merged_weight for path, layer in lora_layers(model)}
    return base, merged


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """``with adapters_disabled(model):`` every adapted layer computes its base ``W x`` alone
    (the adapter branch is skipped, so the outputs are bit-identical to the base model's):
    the frozen base serves as the reference policy. Restores the previous state on exit."""
    layers = [layer for _, layer in lora_layers(model)]
    before = [layer.lora_enabled for layer in layers]
    for layer in layers:
        layer.lora_enabled = False
    try:
        yield
    finally:
        for layer, enabled in zip(layers, before, strict=True):
            layer.lora_enabled = enabled


__all__ = ["LORA_TARGETS", "COLUMN_TARGETS", "ROW_TARGETS", "ADAPTER_PARTS", "LoRASettings", "LoRALayerMixin",
           "apply_lora", "is_adapter_name", "lora_layers", "has_lora", "adapter_parameters",
           "weight_sync_sources", "adapters_disabled", "global_module_path"]
