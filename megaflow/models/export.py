"""Export a built (and possibly trained) megatron-core model as an HF checkpoint directory.

Collective over the model's ranks: tensors are gathered one at a time
(:func:`megaflow.models.weights.iter_hf_tensors`) and streamed by the writer rank into
safetensors shards, followed by ``config.json`` and the tokenizer files. The result loads
with ``transformers.AutoModelForCausalLM.from_pretrained`` (or
``AutoModelForSequenceClassification`` for a critic / reward model).

A LoRA-trained model exports its frozen base as the HF checkpoint (the adapter parameters
are not merged in) and, given ``adapter``, the adapters in Hugging Face PEFT layout in the
``adapter/`` subdirectory (``adapter_config.json`` + ``adapter_model.safetensors``,
:mod:`megaflow.models.peft_io`): ``PeftModel.from_pretrained(AutoModelForCausalLM
.from_pretrained(out_dir), out_dir / "adapter")`` is the trained policy, and
``tools/merge_lora.py`` folds it into one full checkpoint.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megaflow.models.hf_io import CheckpointError, HFShardWriter, copy_tokenizer_files
from megaflow.models.hf_mapping import ModelSpec, expected_hf_keys, hf_shape
from megaflow.models.weights import is_export_writer, iter_hf_tensors, plan_export, unwrap_model_chunks
from megaflow.utils.atomic_dir import check_output_dir, commit_directory, temporary_sibling

if TYPE_CHECKING:
    from megaflow.models.peft_io import PeftAdapter

#: Subdirectory of an HF export holding a LoRA adapter in PEFT layout.
ADAPTER_SUBDIR = "adapter"
_ARCH_PREFIX = {"llama": "Llama", "qwen2": "Qwen2"}


def hf_config_for_export(hf_config: Any, spec: ModelSpec, dtype: torch.dtype):
    """A ``PretrainedConfig`` for the exported weights: same architecture fields, the tie
    flag preserved, ``dtype`` set, and ``architectures`` naming the head that was exported
    (``*ForCausalLM`` or ``*ForSequenceClassification`` with ``num_labels=1``)."""
    from transformers import AutoConfig, PretrainedConfig

    cfg = dict(hf_config) if not isinstance(hf_config, PretrainedConfig) else hf_config.to_dict()
    cfg = {k: v for k, v in cfg.items() if k not in ("transformers_version", "quantization_config")}
    model_type = cfg.pop("model_type")
    kind = "ForSequenceClassification" if spec.head == "score" else "ForCausalLM"
    cfg["architectures"] = [_ARCH_PREFIX[model_type] + kind]
    if spec.head == "score":
        for key in ("id2label", "label2id"):
            cfg.pop(key, None)
        cfg.update(num_labels=1, tie_word_embeddings=False)
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    cfg.pop("torch_dtype", None)
    return AutoConfig.for_model(model_type, **cfg)


def export_hf_dir(model_chunks: Any, hf_config: Any, parallel_info: Any,
                  out_dir: str | os.PathLike, *, dtype: torch.dtype | None = None,
                  hf_files_from: str | os.PathLike | None = None, atomic: bool = True,
                  overwrite: bool = False, max_shard_bytes: int = 2 * 1024**3,
                  progress: bool = False, adapter: PeftAdapter | None = None,
                  adapter_dropout: float = 0.0) -> Path | None:
    """Write the model as an HF checkpoint directory (collective; see module docstring).

    Args:
        model_chunks: this rank's GPTModel (or chunks), built from ``hf_config``.
        hf_config: the HF config the model was built from.
        parallel_info: :class:`megaflow.megatron.parallel.ParallelInfo`.
        out_dir: target directory, written by the writer rank only.
        dtype: dtype of the saved tensors (default: the model's).
        hf_files_from: directory whose tokenizer/generation files are copied through.
        atomic: write a hidden temporary sibling and rename it into place; False writes
            into ``out_dir`` directly (the caller owns atomicity).
        overwrite: replace an existing ``out_dir``.
        max_shard_bytes: safetensors shard size bound.
        progress: tqdm bar on the writer rank.
        adapter: LoRA adapters of the model in PEFT layout, written (in ``dtype`` when given)
            to ``out_dir/adapter`` inside the same atomic directory (module docstring).
        adapter_dropout: ``lora_dropout`` recorded in the adapter's config.

    Returns:
        ``out_dir`` on the writer rank, None on the others.

    Raises:
        FileExistsError: ``out_dir`` exists without ``overwrite`` (writer rank).
        CheckpointError: the gathered names/shapes differ from what ``hf_config`` implies.
    """
    from tqdm.auto import tqdm

    chunks = unwrap_model_chunks(model_chunks)
    plan = plan_export(chunks, hf_config, parallel_info)
    spec = plan.spec
    writer = is_export_writer(parallel_info)
    tensors = iter_hf_tensors(chunks, hf_config, parallel_info, dtype=dtype, plan=plan)
    if not writer:
        for _ in tensors:
            pass
        return None
    final = check_output_dir(out_dir, overwrite=overwrite or not atomic)
    work = temporary_sibling(final) if atomic else final
    work.mkdir(parents=True, exist_ok=True)
    try:
        expected = expected_hf_keys(spec)
        out = HFShardWriter(work, max_shard_bytes)
        written_dtype = None
        for name, tensor in tqdm(tensors, total=len(expected), desc="exporting HF tensors",
                                 unit="tensor", disable=not progress):
            if tuple(tensor.shape) != hf_shape(name, spec):
                raise CheckpointError(f"exported {name} has shape {tuple(tensor.shape)}, "
                                      f"expected {hf_shape(name, spec)}")
            out.add(name, tensor)
            written_dtype = tensor.dtype
        names = out.names
        if names != expected:
            raise CheckpointError(f"exported tensors differ from the expected key set: missing "
                                  f"{sorted(set(expected) - set(names))}, extra "
                                  f"{sorted(set(names) - set(expected))}")
        out.close()
        assert written_dtype is not None  # the expected key set is never empty
        hf_config_for_export(hf_config, spec, written_dtype).save_pretrained(work)
        if hf_files_from is not None:
            copy_tokenizer_files(hf_files_from, work)
        if adapter is not None:
            from megaflow.models.peft_io import write_peft_adapter

            write_peft_adapter(adapter, work / ADAPTER_SUBDIR, base_model=final, dropout=adapter_dropout, dtype=dtype)
        if atomic:
            commit_directory(work, final)
    except BaseException:
        if atomic:
            shutil.rmtree(work, ignore_errors=True)
        raise
    return final


__all__ = ["ADAPTER_SUBDIR", "export_hf_dir", "hf_config_for_export"]
