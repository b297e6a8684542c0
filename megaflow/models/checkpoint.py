"""megaflow model checkpoints: megatron-core distributed checkpointing plus HF metadata.

Layout of a checkpoint directory::

    COMPLETE                  marker, JSON; written last: without it the checkpoint is refused
    MANIFEST.json             size and sha256 of every other file (megaflow.utils.integrity),
                              verified before anything is read
    megaflow_checkpoint.json  metadata: format version, HF config, tie flag, vocab sizes,
                              dtype, the TP/PP it was saved at, layer spec, versions
    hf/                       config.json + tokenizer files, copied through for export
    model/                    megatron-core distributed checkpoint of the model's
                              ``sharded_state_dict()`` (torch_dist format)

Because the tensors are stored as global tensors with per-rank shards
(``megatron.core.dist_checkpointing``), a checkpoint saved at one TP/PP loads at any
other; the vocabulary rows are stored padded and re-padded on load (megatron-core marks
embedding/output shards ``allow_shape_mismatch``).

Loading executes no code from the files: the distributed checkpoint's pickled index and
byte items are read with restricted unpicklers first
(:func:`megaflow.utils.integrity.check_dcp_pickles`), and a checkpoint whose manifest
does not match its files is refused naming the file.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megaflow.models.hf_io import CheckpointError, copy_tokenizer_files
from megaflow.models.hf_mapping import ModelSpec
from megaflow.models.weights import unwrap_model_chunks as _chunks
from megaflow.utils.atomic_dir import (
    COMPLETE_MARKER,
    check_output_dir,
    commit_directory,
    seal_directory,
    temporary_sibling,
)
from megaflow.utils.integrity import IntegrityError, check_dcp_pickles, read_json, verify_manifest

if TYPE_CHECKING:  # megatron-core has no type information: GPTModel reads as Any
    from megatron.core.models.gpt import GPTModel

FORMAT = "megaflow-megatron"
FORMAT_VERSION = 1
METADATA_FILE = "megaflow_checkpoint.json"
MODEL_SUBDIR = "model"
HF_SUBDIR = "hf"


def _sharded_state_dict(chunks: list[GPTModel]) -> dict[str, Any]:
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def save_sharded(sharded_state_dict: dict[str, Any], directory: str | os.PathLike) -> None:
    """``megatron.core.dist_checkpointing.save(sharded_state_dict, directory)`` (collective;
    synchronous, megatron-core's default ``torch_dist`` format), with the writer's results kept
    in this process. megaflow saves every model and optimizer state through it.

    megatron-core's writer relays each save's write results through one queue per process,
    made on first use from a ``multiprocessing`` Manager of the ``spawn`` method
    (``filesystem_async._get_write_results_queue``) for asynchronous saves, whose writer runs in
    another process. In a synchronous save the same process puts the results and gets them
    back, so during the save it gets an in-process ``queue.Queue`` instead (the module's previous
    queue is restored afterwards). The spawned manager re-ran the process's main script (Ray's
    worker) and imported torch to unpickle the first results: the tiny recipe's first checkpoint
    took 5.1-5.4 s against 0.6-0.7 s without it (2 runs each, idle 2-core CPU; later ones 0.5-0.8 s
    either way), and every rank kept a 305 MB process for the rest of the run.

    Raises:
        CheckpointingException: (megatron-core) the ranks' shards overlap or leave gaps.
        CheckpointException: (torch.distributed.checkpoint) a rank's writer failed.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    before = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        dist_checkpointing.save(sharded_state_dict, str(directory))
    finally:
        filesystem_async._results_queue = before


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
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "hf_config": cfg,
        "tie_word_embeddings": spec.tie_word_embeddings, "vocab_size": spec.vocab_size,
        "padded_vocab_size": chunks[0].vocab_size, "dtype": str(param.dtype).removeprefix("torch."),
        "tp": parallel_info.tp_size, "pp": parallel_info.pp_size,
        "layer_spec": layer_spec_of(chunks),
        "megatron_core_version": mcore_version, "torch_version": torch.__version__,
    }
    meta.update(extra or {})
    return meta


#: The layer specs a checkpoint records (``layer_spec`` in ``megaflow_checkpoint.json``).
LAYER_SPECS = ("local", "transformer_engine")
#: Parameter names per spec of the fused norms (megatron-core's local spec stores them under
#: the Transformer Engine keys through its ``sharded_state_dict_keys_map``, so the stored
#: tensors agree; only ``_extra_state`` objects differ between the specs).
NORM_NAMES = {"local": ("input_layernorm.weight", "pre_mlp_layernorm.weight"),
              "transformer_engine": ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")}


def layer_spec_of(model_chunks: Any) -> str:
    """``"transformer_engine"`` when the layers' norms are fused into ``linear_qkv`` /
    ``linear_fc1`` (``layer_norm_weight``, Transformer Engine's spec), else ``"local"``."""
    names = (n for c in _chunks(model_chunks) for n, _ in c.named_parameters())
    return "transformer_engine" if any(n.endswith("layer_norm_weight") for n in names) else "local"


def _without_extra_state(sharded: dict[str, Any]) -> dict[str, Any]:
    """``sharded`` (chunk key -> entries) less every ``_extra_state`` object."""
    return {chunk_key: {k: v for k, v in entries.items() if not k.endswith("_extra_state")}
            for chunk_key, entries in sharded.items()}


def _check_layer_spec(meta: dict, model_spec: str, ckpt_dir: str | os.PathLike) -> str:
    stored = meta.get("layer_spec", "local")
    if stored not in LAYER_SPECS or model_spec not in LAYER_SPECS:
        raise CheckpointError(f"{ckpt_dir} was saved with layer_spec={stored!r}, the model to load uses "
                              f"layer_spec={model_spec!r}; megaflow maps between {list(LAYER_SPECS)} only")
    return stored


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
        atomic: write into a hidden temporary sibling and rename it into place. False
            writes into ``ckpt_dir`` directly (for callers that own the atomicity, e.g. the
            trainer's checkpoint manager). Either way the directory is sealed last
            (``MANIFEST.json``, then ``COMPLETE``).
        overwrite: replace an existing ``ckpt_dir`` (atomic saves only).
        extra_metadata: merged into ``megaflow_checkpoint.json``.

    Returns:
        ``ckpt_dir`` as a Path.

    Raises:
        FileExistsError: ``ckpt_dir`` exists (and is not empty) without ``overwrite``.
    """
    chunks = _chunks(model_chunks)
    final = Path(ckpt_dir).absolute()
    rank = dist.get_rank()
    target: list[str | Exception | None] = [None]
    if rank == 0:
        try:
            check_output_dir(final, overwrite=overwrite or not atomic)
            work_dir = str(temporary_sibling(final)) if atomic else str(final)
            target = [work_dir]
            (Path(work_dir) / MODEL_SUBDIR).mkdir(parents=True, exist_ok=True)
            (Path(work_dir) / COMPLETE_MARKER).unlink(missing_ok=True)  # a previous save's
        except Exception as err:  # noqa: BLE001 - reported on every rank below
            target = [err]
    dist.broadcast_object_list(target, src=0)
    if isinstance(target[0], Exception):
        raise target[0]
    work = Path(str(target[0]))
    try:
        save_sharded(_sharded_state_dict(chunks), work / MODEL_SUBDIR)
        metadata = checkpoint_metadata(chunks, hf_config, parallel_info, extra_metadata)
        dist.barrier()
        if rank == 0:
            _write_hf_files(work / HF_SUBDIR, hf_config, hf_files_from)
            (work / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True))
            seal_directory(work, {"format": FORMAT})
            if atomic:
                commit_directory(work, final)
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


def _model_dirs_below(directory: Path) -> list[Path]:
    """Model checkpoints inside a trainer checkpoint (``actor/model``, ``critic/model``), or
    inside the newest step of a run's ``checkpoints/`` directory."""
    found = sorted(p.parent for p in directory.glob(f"*/{MODEL_SUBDIR}/{METADATA_FILE}"))
    found += sorted(p.parent for p in directory.glob(f"{MODEL_SUBDIR}/{METADATA_FILE}"))
    if not found:
        steps = sorted((int(p.name.removeprefix("global_step_")), p) for p in directory.glob("global_step_*")
                       if p.name.removeprefix("global_step_").isdigit() and (p / COMPLETE_MARKER).is_file())
        if steps:
            found = _model_dirs_below(steps[-1][1])
    return found


def read_checkpoint_metadata(ckpt_dir: str | os.PathLike) -> dict:
    """Read ``megaflow_checkpoint.json`` of a complete checkpoint (no process group needed).

    Raises:
        CheckpointError: the directory is missing; is a trainer checkpoint (``global_step_N``),
            a role directory or a run's ``checkpoints/`` (the message names the model
            directories inside to use instead); has no metadata or no ``COMPLETE`` marker
            (an interrupted save); or is of another format/version.
    """
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / METADATA_FILE
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {ckpt_dir} does not exist")
    if not path.is_file():
        inside = _model_dirs_below(ckpt_dir)
        if inside:
            raise CheckpointError(f"{ckpt_dir} is not a model checkpoint but holds "
                                  f"{'them' if len(inside) > 1 else 'one'}: use "
                                  + " or ".join(str(p) for p in inside))
        raise CheckpointError(f"{ckpt_dir} is not a complete megaflow checkpoint: {METADATA_FILE} "
                              "is missing (interrupted save, or not a megaflow checkpoint)")
    if not (ckpt_dir / COMPLETE_MARKER).is_file():
        raise CheckpointError(f"{ckpt_dir} is not a complete megaflow checkpoint: it has no {COMPLETE_MARKER} "
                              "marker (the save was interrupted)")
    try:
        meta = read_json(path)
    except IntegrityError as err:
        raise CheckpointError(str(err)) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        got = meta if isinstance(meta, dict) else {}
        raise CheckpointError(f"{path}: format {got.get('format')!r} version {got.get('format_version')!r}; "
                              f"expected {FORMAT!r} version {FORMAT_VERSION}")
    return meta


def verify_checkpoint_files(ckpt_dir: str | os.PathLike, *, checksums: bool = True) -> None:
    """Check a checkpoint's files before anything reads them (no process group needed).

    Every file against ``MANIFEST.json`` (presence, size, sha256 unless ``checksums`` is
    False), then the distributed checkpoint's pickles with restricted unpicklers, then that
    every tensor file its index refers to is long enough.

    Raises:
        CheckpointError: naming the missing, unlisted, resized, corrupt or truncated file,
            or the file holding a refused pickle.
    """
    model_dir = Path(ckpt_dir) / MODEL_SUBDIR
    try:
        verify_manifest(ckpt_dir, checksums=checksums)
        storage = check_dcp_pickles(model_dir).storage_data or {}
    except IntegrityError as err:
        raise CheckpointError(str(err)) from None
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


def verify_on_rank0(check, *args: Any, **kwargs: Any) -> None:
    """Run ``check(*args, **kwargs)`` on rank 0 only and raise its error on every rank
    (collective: the ranks share the checkpoint's filesystem, one reader suffices)."""
    outcome: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            check(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            outcome = [CheckpointError(str(err))]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise outcome[0]


def load_checkpoint(model_chunks: Any, ckpt_dir: str | os.PathLike, *, strict: bool = True) -> dict:
    """Load a checkpoint saved by :func:`save_checkpoint` into built model chunks (collective).

    The model may use another TP/PP (and so another padded vocabulary) than the saver.

    Returns:
        The checkpoint's metadata.

    Raises:
        CheckpointError: incomplete/foreign checkpoint, a file that differs from the
            manifest, a refused pickle, missing or truncated tensor files, a model whose
            layer count or hidden size differs from the stored HF config, or a layer spec
            (``local`` / ``transformer_engine``, recorded at save) that cannot be mapped onto
            the model's (both named).

    Layer specs: a checkpoint saved with megatron-core's local spec loads into a model built
    with Transformer Engine's and back. The fused norms are stored under the same keys by
    both (:data:`NORM_NAMES`: the local spec's ``sharded_state_dict_keys_map``); the
    ``_extra_state`` objects, which differ between the specs (TE's FP8 metadata, its
    attention's), are ignored and the model keeps the state it was built with.
    """
    from megatron.core import dist_checkpointing

    def verify() -> None:
        read_checkpoint_metadata(ckpt_dir)
        verify_checkpoint_files(ckpt_dir)

    verify_on_rank0(verify)
    meta = read_checkpoint_metadata(ckpt_dir)
    chunks = _chunks(model_chunks)
    stored = ModelSpec.from_hf_config(meta["hf_config"])
    config = chunks[0].config
    have = (config.num_layers, config.hidden_size, config.num_attention_heads)
    want = (stored.num_layers, stored.hidden_size, stored.num_heads)
    if have != want:
        raise CheckpointError(f"{ckpt_dir} holds a model with (num_layers, hidden_size, "
                              f"num_heads)={want}, the model to load has {have}")
    model_spec = layer_spec_of(chunks)
    stored_spec = _check_layer_spec(meta, model_spec, ckpt_dir)
    sharded = _sharded_state_dict(chunks)
    if stored_spec != model_spec:
        # the tensors are stored under the same keys by both specs; the specs' _extra_state objects
        # differ (e.g. TE's core attention): ignored, the model keeps the state it was built with
        sharded = _without_extra_state(sharded)
        stored = dist_checkpointing.load_tensors_metadata(str(Path(ckpt_dir) / MODEL_SUBDIR))
        missing = sorted({v.key for entries in sharded.values() for v in entries.values()
                          if hasattr(v, "key") and v.key not in stored})
        if missing:
            raise CheckpointError(f"{ckpt_dir} was saved with layer_spec={stored_spec!r} and cannot be mapped onto "
                                  f"the model's layer_spec={model_spec!r}: the checkpoint has no {missing[:4]}")
    state = dist_checkpointing.load(sharded, str(Path(ckpt_dir) / MODEL_SUBDIR))
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for chunk, key in zip(chunks, keys, strict=True):
        if stored_spec != model_spec:  # every _extra_state the checkpoint did not give: the model's own
            own = chunk.state_dict()
            state[key].update({k: v for k, v in own.items() if k.endswith("_extra_state") and k not in state[key]})
        chunk.load_state_dict(state[key], strict=strict)
    return meta


__all__ = ["save_checkpoint", "save_sharded", "load_checkpoint", "read_checkpoint_metadata", "layer_spec_of",
           "LAYER_SPECS", "NORM_NAMES",
           "verify_checkpoint_files", "verify_on_rank0",
           "checkpoint_metadata", "METADATA_FILE", "MODEL_SUBDIR", "HF_SUBDIR", "FORMAT",
           "FORMAT_VERSION"]
