"""megaflow model checkpoints: megatron-core distributed checkpointing plus HF metadata.

Layout of a checkpoint directory::

    COMPLETE                  marker (atomic saves only), JSON
    megaflow_checkpoint.json  metadata: format version, HF config, tie flag, vocab sizes,
                              dtype, the TP/PP it was saved at, layer spec, versions
    hf/                       config.json + tokenizer files, copied through for export
    model/                    megatron-core distributed checkpoint of the model's
                              ``sharded_state_dict()`` (torch_dist format)

Because the tensors are stored as global tensors with per-rank shards
(``megatron.core.dist_checkpointing``), a checkpoint saved at one TP/PP loads at any
other; the vocabulary rows are stored padded and re-padded on load (megatron-core marks
embedding/output shards ``allow_shape_mismatch``).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megaflow.utils.atomic_dir import check_output_dir, commit_directory, temporary_sibling
from megaflow.models.hf_io import CheckpointError, copy_tokenizer_files
from megaflow.models.hf_mapping import ModelSpec
from megaflow.models.weights import unwrap_model_chunks as _chunks

FORMAT = "megaflow-megatron"
FORMAT_VERSION = 1
METADATA_FILE = "megaflow_checkpoint.json"
MODEL_SUBDIR = "model"
HF_SUBDIR = "hf"


def _sharded_state_dict(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def _config_dict(hf_config: Any) -> dict:
    return dict(hf_config) if isinstance(hf_config, dict) else hf_config.to_dict()


def checkpoint_metadata(model_chunks: Any, hf_config: Any, parallel_info: Any,
                        extra: dict | None = None) -> dict:
    """The metadata recorded next to the tensors (see module docstring)."""
    from megatron.core import __version__ as mcore_version

    chunks = _chunks(model_chunks)
    cfg = _config_dict(hf_config)
    spec = ModelSpec.from_hf_config(cfg)
    param = next(chunks[0].parameters())
    names = {n for c in chunks for n, _ in c.named_parameters()}
    te = any(n.endswith("layer_norm_weight") for n in names)
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "hf_config": cfg,
        "tie_word_embeddings": spec.tie_word_embeddings, "vocab_size": spec.vocab_size,
        "padded_vocab_size": chunks[0].vocab_size, "dtype": str(param.dtype).removeprefix("torch."),
        "tp": parallel_info.tp_size, "pp": parallel_info.pp_size,
        "layer_spec": "transformer_engine" if te else "local",
        "megatron_core_version": mcore_version, "torch_version": torch.__version__,
    }
    meta.update(extra or {})
    return meta


def save_checkpoint(model_chunks: Any, ckpt_dir: str | os.PathLike, hf_config: Any,
                    parallel_info: Any, *, hf_files_from: str | os.PathLike | None = None,
                    atomic: bool = True, overwrite: bool = False,
                    extra_metadata: dict | None = None) -> Path:
    """Save the model with megatron-core distributed checkpointing (collective, all ranks).

    Args:
        model_chunks: this rank's GPTModel (or chunks).
        ckpt_dir: target directory (same path on every rank, on a shared filesystem).
        hf_config: the HF config the model was built from (stored for export).
        parallel_info: :class:`megaflow.megatron.parallel.ParallelInfo`.
        hf_files_from: an HF directory whose tokenizer/generation files are copied into
            ``hf/`` (for a later export).
        atomic: write into a hidden temporary sibling and rename it into place with a
            ``COMPLETE`` marker. False writes into ``ckpt_dir`` directly (for callers that
            own the atomicity, e.g. the trainer's checkpoint manager).
        overwrite: replace an existing ``ckpt_dir`` (atomic saves only).
        extra_metadata: merged into ``megaflow_checkpoint.json``.

    Returns:
        ``ckpt_dir`` as a Path.

    Raises:
        FileExistsError: ``ckpt_dir`` exists (and is not empty) without ``overwrite``.
    """
    from megatron.core import dist_checkpointing

    chunks = _chunks(model_chunks)
    final = Path(ckpt_dir).absolute()
    rank = dist.get_rank()
    target = [None]
    if rank == 0:
        try:
            check_output_dir(final, overwrite=overwrite or not atomic)
            target = [str(temporary_sibling(final)) if atomic else str(final)]
            (Path(target[0]) / MODEL_SUBDIR).mkdir(parents=True, exist_ok=True)
        except Exception as err:  # noqa: BLE001 - reported on every rank below
            target = [err]
    dist.broadcast_object_list(target, src=0)
    if isinstance(target[0], Exception):
        raise target[0]
    work = Path(target[0])
    try:
        dist_checkpointing.save(_sharded_state_dict(chunks), str(work / MODEL_SUBDIR))
        metadata = checkpoint_metadata(chunks, hf_config, parallel_info, extra_metadata)
        dist.barrier()
        if rank == 0:
            _write_hf_files(work / HF_SUBDIR, hf_config, hf_files_from)
            (work / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True))
            if atomic:
                commit_directory(work, final, marker={"format": FORMAT})
        dist.barrier()
    except BaseException:
        if atomic and rank == 0:
            shutil.rmtree(work, ignore_errors=True)
        raise
    return final


def _write_hf_files(directory: Path, hf_config: Any, hf_files_from: str | os.PathLike | None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(_config_dict(hf_config), indent=2,
                                                      sort_keys=True, default=str))
    if hf_files_from is not None:
        copy_tokenizer_files(hf_files_from, directory)


def read_checkpoint_metadata(ckpt_dir: str | os.PathLike) -> dict:
    """Read ``megaflow_checkpoint.json`` (no process group needed).

    Raises:
        CheckpointError: the directory is missing, incomplete (no metadata file: the save
            did not finish) or of another format/version.
    """
    path = Path(ckpt_dir) / METADATA_FILE
    if not Path(ckpt_dir).is_dir():
        raise CheckpointError(f"checkpoint directory {ckpt_dir} does not exist")
    if not path.is_file():
        raise CheckpointError(f"{ckpt_dir} is not a complete megaflow checkpoint: {METADATA_FILE} "
                              "is missing (interrupted save, or not a megaflow checkpoint)")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} version "
                              f"{meta.get('format_version')!r}; expected {FORMAT!r} "
                              f"version {FORMAT_VERSION}")
    return meta


def verify_checkpoint_files(ckpt_dir: str | os.PathLike) -> None:
    """Check that every tensor file the distributed checkpoint's index refers to exists and
    is long enough (cheap, no process group; catches deleted or truncated shard files).

    Raises:
        CheckpointError: naming the missing or truncated file.
    """
    from torch.distributed.checkpoint import FileSystemReader

    model_dir = Path(ckpt_dir) / MODEL_SUBDIR
    try:
        storage = FileSystemReader(str(model_dir)).read_metadata().storage_data or {}
    except Exception as err:  # noqa: BLE001 - any unreadable index is a broken checkpoint
        raise CheckpointError(f"cannot read the tensor index of {model_dir}: {err}") from err
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = model_dir / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        if path.stat().st_size < size:
            raise CheckpointError(f"checkpoint file {path} is truncated: {path.stat().st_size} "
                                  f"bytes, the index needs {size}")


def load_checkpoint(model_chunks: Any, ckpt_dir: str | os.PathLike, *, strict: bool = True) -> dict:
    """Load a checkpoint saved by :func:`save_checkpoint` into built model chunks (collective).

    The model may use another TP/PP (and so another padded vocabulary) than the saver.

    Returns:
        The checkpoint's metadata.

    Raises:
        CheckpointError: incomplete/foreign checkpoint, missing or truncated tensor files,
            or a model whose layer count or hidden size differs from the stored HF config.
    """
    from megatron.core import dist_checkpointing

    meta = read_checkpoint_metadata(ckpt_dir)
    verify_checkpoint_files(ckpt_dir)
    chunks = _chunks(model_chunks)
    stored = ModelSpec.from_hf_config(meta["hf_config"])
    config = chunks[0].config
    have = (config.num_layers, config.hidden_size, config.num_attention_heads)
    want = (stored.num_layers, stored.hidden_size, stored.num_heads)
    if have != want:
        raise CheckpointError(f"{ckpt_dir} holds a model with (num_layers, hidden_size, "
                              f"num_heads)={want}, the model to load has {have}")
    state = dist_checkpointing.load(_sharded_state_dict(chunks), str(Path(ckpt_dir) / MODEL_SUBDIR))
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for chunk, key in zip(chunks, keys):
        chunk.load_state_dict(state[key], strict=strict)
    return meta


__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint_metadata",
           "verify_checkpoint_files",
           "checkpoint_metadata", "METADATA_FILE", "MODEL_SUBDIR", "HF_SUBDIR", "FORMAT",
           "FORMAT_VERSION"]
