"""Engine checkpoints for the trainer's save/load hooks: model + optimizer + LR schedule.

Layout of ``path``::

    model/...        megaflow model checkpoint (megaflow.models.checkpoint; loadable at any TP/PP)
    optimizer/       megatron-core distributed checkpoint of the optimizer state
                     (``optimizer.sharded_state_dict(model.sharded_state_dict())``)
    scheduler.json   OptimizerParamScheduler.state_dict() (identical on every rank), JSON
    layout.json      the engine's parallel sizes {tp, pp, cp, dp, vpp, ep, world_size}

The optimizer state is saved in megatron-core's ``dp_reshardable`` format: each rank
writes its DP shard of the distributed optimizer's buckets, and a load at another DP size
reshards them (``tests/megatron/test_dist_optimizer_resize.py``: written at DP=2, resumed
exactly at DP=1). The buckets follow the model-parallel shard, so the optimizer state
only loads at the tp, pp, cp and vpp sizes it was saved with (the trainer checks them
against ``layout.json`` before any process starts); the model part loads at any layout.
Mixture-of-experts models: the expert parameters' optimizer state is sharded over the
expert-data-parallel group (``dp * cp / ep`` ranks) in buckets of this EP rank's experts,
so it loads only at the saved ``ep`` too (checked before start by the trainer, and here by
:func:`load_engine_checkpoint`, naming ``<role>.ep``); a checkpoint without ``ep`` was
written at ep = 1.
LoRA (``<role>.lora.rank > 0``): the checkpoint is adapter-only. ``model/`` is replaced by::

    adapter/         megatron-core distributed checkpoint of the trained parameters only: the
                     ``lora_a``/``lora_b`` entries of ``model.sharded_state_dict()`` and, for a
                     critic, its fully trained value head (``output_layer.weight``)
    lora.json        the LoRA settings (rank, alpha, dropout, target_modules), the base's
                     source (``<role>``'s model path or key) and the sha256 of the frozen base
                     parameters per (tp, pp) rank

The optimizer holds the trained parameters' state only (the base is frozen). A load rebuilds the base
from the run's model source, as at the start, and refuses a checkpoint whose LoRA settings or
base fingerprint differ, naming the key (``<role>.lora.<setting>`` or the model source's key).
Atomicity and the manifest are the caller's (the trainer's checkpoint manager writes into
a temporary directory, seals it and renames it). No file is unpickled without the
restricted readers of :mod:`megaflow.utils.integrity`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MODEL_DIR, OPTIMIZER_DIR, SCHEDULER_FILE, LAYOUT_FILE = "model", "optimizer", "scheduler.json", "layout.json"
ADAPTER_DIR, LORA_FILE = "adapter", "lora.json"
_LORA_KEYS = ("rank", "alpha", "dropout", "target_modules")
# The distributed optimizer's state saved per DP shard; it loads at any DP size and the
# saved model-parallel sizes.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _model_sharded_state_dict(engine):
    return engine.module.sharded_state_dict()


def engine_layout(info) -> dict[str, int | None]:
    """The parallel sizes recorded in ``layout.json``, from a ``ParallelInfo``."""
    return {"tp": info.tp_size, "pp": info.pp_size, "cp": info.cp_size, "dp": info.dp_size,
            "vpp": info.vpp_size, "ep": getattr(info, "ep_size", 1), "world_size": info.world_size}


def save_engine_checkpoint(engine, path: str | os.PathLike, hf_config, *,
                           hf_files_from: str | None = None) -> Path:
    """Save ``engine``'s model (and optimizer/scheduler when training) under ``path`` (collective).

    Raises:
        TypeError: the scheduler state holds a value JSON cannot represent.
    """
    from megaflow.models.checkpoint import save_checkpoint, save_sharded

    root = Path(path).absolute()
    lora = _lora_record(engine)
    if lora is not None:
        if dist.get_rank() == 0:
            (root / ADAPTER_DIR).mkdir(parents=True, exist_ok=True)
            (root / LORA_FILE).write_text(json.dumps(lora, indent=1, sort_keys=True))
        dist.barrier()
        save_sharded(_adapter_sharded_state_dict(engine), root / ADAPTER_DIR)
    else:
        save_checkpoint(engine.module, root / MODEL_DIR, hf_config, engine.info,
                        hf_files_from=hf_files_from, atomic=False, overwrite=True)
    if engine.optimizer is not None:
        if dist.get_rank() == 0:
            (root / OPTIMIZER_DIR).mkdir(parents=True, exist_ok=True)
            (root / SCHEDULER_FILE).write_text(json.dumps(engine.scheduler.state_dict(), indent=1,
                                                          sort_keys=True, allow_nan=False))
        dist.barrier()
        state = engine.optimizer.sharded_state_dict(_model_sharded_state_dict(engine),
                                                    metadata=_OPTIMIZER_METADATA)
        save_sharded(state, root / OPTIMIZER_DIR)
    if dist.get_rank() == 0:
        (root / LAYOUT_FILE).write_text(json.dumps(engine_layout(engine.info), indent=1, sort_keys=True))
    dist.barrier()
    return root


def load_engine_checkpoint(engine, path: str | os.PathLike) -> None:
    """Load what :func:`save_engine_checkpoint` wrote into a built engine (collective).

    Raises:
        FileNotFoundError: ``path`` lacks the model part, or the optimizer part when the
            engine trains.
    """
    from megatron.core import dist_checkpointing

    from megaflow.models.checkpoint import load_checkpoint, verify_on_rank0
    from megaflow.utils.integrity import check_dcp_pickles

    root = Path(path)
    if (root / ADAPTER_DIR).is_dir():
        _load_adapters(engine, root)
    elif not (root / MODEL_DIR).is_dir():
        raise FileNotFoundError(f"{root} has no {MODEL_DIR}/ or {ADAPTER_DIR}/ (not an engine checkpoint)")
    else:
        load_checkpoint(engine.module, root / MODEL_DIR)
    if engine.optimizer is None:
        return
    if not (root / OPTIMIZER_DIR).is_dir() or not (root / SCHEDULER_FILE).is_file():
        raise FileNotFoundError(f"{root} has no optimizer state ({OPTIMIZER_DIR}/, {SCHEDULER_FILE})")
    _check_saved_expert_parallel(root, engine)
    verify_on_rank0(check_dcp_pickles, root / OPTIMIZER_DIR)  # before megatron-core unpickles anything
    _materialize_adam_state(engine.optimizer)
    state = engine.optimizer.sharded_state_dict(_model_sharded_state_dict(engine), is_loading=True,
                                                metadata=_OPTIMIZER_METADATA)
    loaded = dist_checkpointing.load(state, str(root / OPTIMIZER_DIR))
    with torch.no_grad():  # fp32 main params are views of the (leaf) model params
        engine.optimizer.load_state_dict(loaded)
    _restore_adam_steps(engine.optimizer, loaded)
    engine.scheduler.load_state_dict(json.loads((root / SCHEDULER_FILE).read_text()))


def _chunks(engine) -> list[Any]:
    from megaflow.models.weights import unwrap_model_chunks

    return list(unwrap_model_chunks(engine.module))


def _trained_entries(chunk: Any) -> dict[str, Any]:
    """The entries of ``chunk.sharded_state_dict()`` whose parameters train under LoRA: the
    adapters and what :func:`megaflow.megatron.lora.apply_lora` kept trainable (a critic's value head)."""
    trained = {name for name, param in chunk.named_parameters() if param.requires_grad}
    return {name: t for name, t in chunk.sharded_state_dict().items() if name in trained}


def _adapter_sharded_state_dict(engine) -> dict[str, Any]:
    """The trained entries (adapters, a critic's value head) of every chunk's ``sharded_state_dict()``
    (keyed like :func:`megaflow.models.checkpoint.save_checkpoint`'s: ``model`` or ``model<i>``)."""
    chunks = _chunks(engine)
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    return {key: _trained_entries(chunk) for key, chunk in zip(keys, chunks, strict=True)}


def _base_sha256(engine) -> str:
    """sha256 over this rank's frozen parameters, by name, in their stored bytes."""
    import hashlib

    digest = hashlib.sha256()
    for i, chunk in enumerate(_chunks(engine)):
        for name, param in sorted(chunk.named_parameters()):
            if not param.requires_grad:
                digest.update(f"{i}.{name}".encode())
                digest.update(param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _lora_record(engine) -> dict[str, Any] | None:
    """What ``lora.json`` holds for ``engine`` (collective: the base fingerprints are gathered),
    or None without LoRA."""
    lora = getattr(engine.spec.section, "lora", None)
    if lora is None or lora.rank == 0:
        return None
    info = engine.info
    mine = (f"tp{info.tp_rank}_pp{info.pp_rank}", _base_sha256(engine))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    source = engine.spec.model_source
    settings = {k: list(v) if isinstance(v, tuple | list) else v for k in _LORA_KEYS for v in [getattr(lora, k)]}
    return {"settings": settings, "base_model": {"key": source.key, "path": source.path},
            "base_sha256": dict(sorted(every))}


def _check_lora_record(engine, root: Path, saved: dict[str, Any], now: dict[str, Any] | None) -> None:
    """Refuse an adapter checkpoint for another LoRA setting or another base.

    Raises:
        ValueError: naming ``<role>.lora.rank`` (LoRA off now), ``<role>.lora.<setting>`` or the
            model source's key (the frozen base differs from the one the adapters were trained on).
    """
    role = engine.spec.role
    if now is None:
        raise ValueError(f"{role}.lora.rank: {root} holds LoRA adapters only and this run has no LoRA")
    for key in _LORA_KEYS:
        if saved["settings"].get(key) != now["settings"][key]:
            raise ValueError(f"{role}.lora.{key}: the adapters in {root} were saved with {saved['settings'].get(key)!r}"
                             f" and this run has {now['settings'][key]!r}")
    source = now["base_model"]
    for where, digest in now["base_sha256"].items():
        if saved["base_sha256"].get(where) != digest:
            raise ValueError(f"{source['key']}: the frozen base ({source['path'] or 'random init'}) differs from "
                             f"the one the adapters in {root} were trained on ({saved['base_model']}; base weights "
                             f"of rank {where} have another sha256)")


def _load_adapters(engine, root: Path) -> None:
    """Load the adapter-only model part into ``engine`` after checking ``lora.json`` (collective)."""
    from megatron.core import dist_checkpointing

    from megaflow.models.checkpoint import verify_on_rank0
    from megaflow.utils.integrity import check_dcp_pickles, read_json

    _check_lora_record(engine, root, read_json(root / LORA_FILE), _lora_record(engine))
    verify_on_rank0(check_dcp_pickles, root / ADAPTER_DIR)  # before megatron-core unpickles anything
    sharded = _adapter_sharded_state_dict(engine)
    loaded = dist_checkpointing.load(sharded, str(root / ADAPTER_DIR))
    with torch.no_grad():
        for key, chunk in zip(sharded, _chunks(engine), strict=True):
            params = dict(chunk.named_parameters())
            for name, tensor in loaded[key].items():
                params[name].copy_(tensor)


def _check_saved_expert_parallel(root: Path, engine) -> None:
    """Refuse optimizer state saved at another expert-parallel size (module docstring).

    Raises:
        ValueError: naming ``<role>.ep``, the saved and the current size.
    """
    layout = root / LAYOUT_FILE
    saved = json.loads(layout.read_text()).get("ep", 1) if layout.is_file() else 1
    current = getattr(engine.info, "ep_size", 1)
    if saved != current:
        raise ValueError(f"{engine.spec.role}.ep: the optimizer state in {root} was saved at ep={saved} and this "
                         f"engine runs at ep={current}; the expert parameters' state only loads at the saved ep "
                         f"(resume with {engine.spec.role}.ep={saved}, or start from the model part "
                         f"{root / MODEL_DIR})")


def _materialize_adam_state(optimizer) -> None:
    """Create torch Adam's per-parameter state (``step``, ``exp_avg``, ``exp_avg_sq``) where
    it does not exist yet, so that a checkpoint can be loaded into an optimizer that has
    never stepped (e.g. when resuming).

    torch creates this state lazily in ``step()``; megatron-core's optimizer ``state_dict``
    (used to build the sharded state dict it loads into) reads ``step`` from it when neither
    Apex nor Transformer Engine provides the fused Adam, and fails on a fresh optimizer.
    The values are placeholders: the load overwrites every one of them.
    """
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    for opt in inner:
        if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state[p]:
                    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                    "exp_avg_sq": torch.zeros_like(p)}


def _saved_steps(state: Any) -> set[Any]:
    """The ``step`` values megatron-core stored in the optimizer part's ``param_groups``."""
    found: set[Any] = set()
    if isinstance(state, dict):
        for key, value in state.items():
            if key == "param_groups" and isinstance(value, list):
                found.update(g["step"] for g in value if isinstance(g, dict) and "step" in g)
            else:
                found |= _saved_steps(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            found |= _saved_steps(value)
    return found


def _restore_adam_steps(optimizer, loaded) -> None:
    """Set every parameter's Adam ``step`` to the saved step count, one tensor each.

    Without Apex or Transformer Engine, megatron-core keeps torch Adam's per-parameter
    ``step`` only in the checkpoint's ``param_groups``; its ``DistributedOptimizer``
    load leaves the restored per-parameter ``step`` at the freshly created value (0 here)
    and assigns one tensor object to every parameter. Adam's bias correction would then
    differ from an uninterrupted run's (and a shared tensor would advance once per
    parameter per step).

    Raises:
        ValueError: the checkpoint holds several different step counts.
    """
    steps = _saved_steps(loaded)
    if not steps:
        return
    if len(steps) > 1:
        raise ValueError(f"optimizer checkpoint holds several Adam step counts {sorted(steps)}")
    step = float(steps.pop())
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    for opt in inner:
        for state in opt.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32)


__all__ = ["save_engine_checkpoint", "load_engine_checkpoint"]
