"""HF <-> megaflow checkpoint conversion (the logic behind ``tools/convert_*.py``).

Both directions validate everything that can be validated in the calling process first
(architecture and config features, TP/PP divisibility, the HF key set and shapes), then
run ``tp * pp`` gloo ranks with :func:`megaflow.utils.launch.run_distributed`, each
holding one TP/PP shard and reading or writing tensors one at a time. Output goes to a
hidden temporary sibling of the target that is renamed into place only after every rank
finished; on any error it is removed, so no partial output directory is left behind.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from megaflow.models.checkpoint import (
    FORMAT,
    HF_SUBDIR,
    load_checkpoint,
    read_checkpoint_metadata,
    save_checkpoint,
    verify_checkpoint_files,
)
from megaflow.models.export import export_hf_dir
from megaflow.models.hf_io import check_hf_dir, read_hf_config
from megaflow.models.hf_mapping import ModelSpec
from megaflow.models.weights import load_hf_weights
from megaflow.utils.atomic_dir import check_output_dir, commit_directory, temporary_sibling

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``"bf16"`` / ``torch.bfloat16`` -> ``torch.bfloat16`` (ValueError otherwise)."""
    if isinstance(name, torch.dtype):
        return name
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    key = aliases.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; choose from {sorted(DTYPES)}")
    return DTYPES[key]


def _check_sizes(tp: int, pp: int) -> None:
    for name, value in (("tp", tp), ("pp", pp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _check_output(out_dir: str | os.PathLike, overwrite: bool) -> Path:
    """:func:`check_output_dir`, and the directory can be created (``--out /dev/null/x``)."""
    from megaflow.utils.paths import why_not_creatable

    final = check_output_dir(out_dir, overwrite)
    problem = why_not_creatable(final.parent)
    if problem is not None:
        raise OSError(f"cannot create output directory {final}: {problem}")
    return final


def validate_layout(hf_config: dict, tp: int, pp: int, dtype: torch.dtype) -> None:
    """Raise ValueError when the model cannot be split into ``tp`` x ``pp`` shards."""
    from megaflow.megatron.model import transformer_config_from_hf

    transformer_config_from_hf(hf_config, dtype=dtype, tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=pp)


def _head(hf_config: dict) -> str:
    """``"reward"`` (scalar head) for sequence-classification checkpoints, else ``"lm"``."""
    return "reward" if ModelSpec.from_hf_config(hf_config).head == "score" else "lm"


def _run_in_tmp(final: Path, fn, world_size: int, *args: Any, timeout_s: float,
                marker: dict | None) -> Path:
    from megaflow.utils.launch import run_distributed

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(final)
    tmp.mkdir()
    try:
        run_distributed(fn, world_size, str(tmp), *args, timeout_s=timeout_s)
        return commit_directory(tmp, final, marker=marker)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def convert_hf_to_megatron(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, tp: int = 1,
                           pp: int = 1, dtype: str | torch.dtype = "float32",
                           overwrite: bool = False, progress: bool = True,
                           timeout_s: float = 3600.0) -> Path:
    """Convert an HF checkpoint directory into a megaflow checkpoint laid out for TP x PP.

    The result is a megatron-core distributed checkpoint (loadable at any TP/PP) plus
    metadata and the HF config/tokenizer files (see :mod:`megaflow.models.checkpoint`).

    Raises:
        UnsupportedModelError / ValueError: unsupported architecture or feature, or a
            TP/PP that does not divide the heads/layers.
        CheckpointError: missing/extra/mis-shaped/truncated tensors (named).
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
        OSError: ``out_dir`` cannot be created (a parent is a file or not writable).
        megaflow.utils.launch.DistributedRunError: a rank failed (its traceback).
    """
    torch_dtype = parse_dtype(dtype)
    _check_sizes(tp, pp)
    hf_config, _ = check_hf_dir(hf_dir)
    validate_layout(hf_config, tp, pp, torch_dtype)
    final = _check_output(out_dir, overwrite)
    return _run_in_tmp(final, _hf_to_megatron_rank, tp * pp, str(Path(hf_dir).absolute()),
                       hf_config, tp, pp, torch_dtype, progress, timeout_s=timeout_s,
                       marker={"format": FORMAT})


def _hf_to_megatron_rank(rank: int, world_size: int, tmp: str, hf_dir: str, hf_config: dict,
                         tp: int, pp: int, dtype: torch.dtype, progress: bool) -> None:
    from megaflow.megatron.model import build_gpt_model
    from megaflow.megatron.parallel import destroy_parallel, initialize_parallel

    info = initialize_parallel(tp=tp, pp=pp)
    try:
        model = build_gpt_model(hf_config, head=_head(hf_config), dtype=dtype)
        load_hf_weights(model, hf_dir, hf_config, info, progress=progress and rank == 0)
        save_checkpoint(model, tmp, hf_config, info, hf_files_from=hf_dir, atomic=False,
                        extra_metadata={"source_hf_dir": hf_dir})
    finally:
        destroy_parallel()


def convert_megatron_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                           tp: int = 1, pp: int = 1, dtype: str | torch.dtype | None = None,
                           overwrite: bool = False, max_shard_bytes: int = 2 * 1024**3,
                           progress: bool = True, timeout_s: float = 3600.0) -> Path:
    """Convert a megaflow checkpoint into an HF directory (safetensors, config, tokenizer).

    Args:
        tp, pp: the layout used to read the checkpoint (any; 1 x 1 needs the whole model
            in one process's memory, larger layouts spread it over ranks).
        dtype: dtype of the written tensors (default: the checkpoint's).

    Raises:
        CheckpointError: not a complete megaflow checkpoint, a missing or truncated tensor
            file, or tensors read back that do not match the stored config.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
        OSError: ``out_dir`` cannot be created (a parent is a file or not writable).
        megaflow.utils.launch.DistributedRunError: a rank failed (e.g. a damaged shard file).
    """
    _check_sizes(tp, pp)
    meta = read_checkpoint_metadata(ckpt_dir)
    verify_checkpoint_files(ckpt_dir)
    ckpt_dtype = parse_dtype(meta["dtype"])
    out_dtype = parse_dtype(dtype) if dtype is not None else ckpt_dtype
    validate_layout(meta["hf_config"], tp, pp, ckpt_dtype)
    final = _check_output(out_dir, overwrite)
    return _run_in_tmp(final, _megatron_to_hf_rank, tp * pp, str(Path(ckpt_dir).absolute()),
                       meta["hf_config"], tp, pp, ckpt_dtype, out_dtype, max_shard_bytes,
                       progress, timeout_s=timeout_s, marker=None)


def _megatron_to_hf_rank(rank: int, world_size: int, tmp: str, ckpt_dir: str, hf_config: dict,
                         tp: int, pp: int, ckpt_dtype: torch.dtype, out_dtype: torch.dtype,
                         max_shard_bytes: int, progress: bool) -> None:
    from megaflow.megatron.model import build_gpt_model
    from megaflow.megatron.parallel import destroy_parallel, initialize_parallel

    info = initialize_parallel(tp=tp, pp=pp)
    try:
        model = build_gpt_model(hf_config, head=_head(hf_config), dtype=ckpt_dtype)
        load_checkpoint(model, ckpt_dir)
        export_hf_dir(model, hf_config, info, tmp, dtype=out_dtype,
                      hf_files_from=Path(ckpt_dir) / HF_SUBDIR, atomic=False,
                      max_shard_bytes=max_shard_bytes, progress=progress)
    finally:
        destroy_parallel()


__all__ = ["convert_hf_to_megatron", "convert_megatron_to_hf", "read_hf_config", "check_hf_dir",
           "validate_layout", "parse_dtype", "DTYPES"]
