"""Reading and writing Hugging Face checkpoint directories, tensor by tensor.

A reader opens every ``*.safetensors`` file of a directory lazily (``safe_open``), so
tensors are read one at a time and only by the ranks that need them; a writer streams
tensors into size-bounded safetensors shards plus ``model.safetensors.index.json`` in the
layout ``transformers.PreTrainedModel.save_pretrained`` produces.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megaflow.models.hf_mapping import EMBED, LM_HEAD, ModelSpec, expected_hf_keys, hf_shape

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
# Files copied from the HF input directory next to the weights on export.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or does not match the model."""


#: safetensors' names of the floating-point element types a checkpoint's weights may have.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
_SAFETENSORS_DTYPE = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


class HFWeights:
    """Tensors of an HF checkpoint, from a directory of safetensors files or a state dict.

    Args:
        source: a directory holding ``model.safetensors`` or an index json with shards, or
            a mapping ``name -> tensor`` (e.g. ``model.state_dict()`` of a transformers
            model).

    Raises:
        CheckpointError: no safetensors files, a shard listed in the index is missing, or a
            file is truncated/corrupt (the file is named).
    """

    def __init__(self, source: str | os.PathLike | Mapping[str, torch.Tensor]):
        self._tensors: Mapping[str, torch.Tensor] | None = None
        self._files: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        if isinstance(source, Mapping):
            self._tensors = source
            return
        directory = Path(source)
        for path in self._shard_paths(directory):
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"cannot read safetensors file {path}: {err} "
                                      "(truncated or corrupt?)") from err
            self._files[str(path)] = handle
            for name in handle.keys():
                if name in self._where:
                    raise CheckpointError(f"tensor {name!r} is stored twice: in "
                                          f"{self._where[name]} and {path}")
                self._where[name] = str(path)

    @staticmethod
    def _shard_paths(directory: Path) -> list[Path]:
        if not directory.is_dir():
            raise CheckpointError(f"HF checkpoint directory {directory} does not exist")
        index = directory / SAFE_INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = set(weight_map.values())
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise CheckpointError(f"{index} is not valid JSON: {err}") from None
            except (KeyError, TypeError, AttributeError):
                raise CheckpointError(f"{index} has no 'weight_map' object of tensor name -> file") from None
            paths = [directory / f for f in sorted(files)]
            missing = [str(p) for p in paths if not p.exists()]
            if missing:
                raise CheckpointError(f"{index} lists shards that do not exist: {missing}")
            return paths
        paths = sorted(directory.glob("*.safetensors"))
        if not paths:
            bins = sorted(p.name for p in directory.glob("*.bin"))
            hint = f" (found {bins}: re-save with safe_serialization=True)" if bins else ""
            raise CheckpointError(f"no *.safetensors files in {directory}{hint}")
        return paths

    def keys(self) -> list[str]:
        """All tensor names."""
        return list(self._tensors.keys()) if self._tensors is not None else list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in (self._tensors if self._tensors is not None else self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` without reading its data."""
        if self._tensors is not None:
            return tuple(self._tensors[name].shape)
        return tuple(self._files[self._where[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """Element type of tensor ``name`` without reading its data: safetensors' name
        (``"F32"``, ``"BF16"``, ``"I32"``...)."""
        if self._tensors is not None:
            return _SAFETENSORS_DTYPE.get(self._tensors[name].dtype, str(self._tensors[name].dtype))
        return self._files[self._where[name]].get_slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor:
        """Read tensor ``name`` (KeyError naming it when absent)."""
        if name not in self:
            raise KeyError(f"HF checkpoint has no tensor {name!r}")
        if self._tensors is not None:
            return self._tensors[name]
        try:
            return self._files[self._where[name]].get_tensor(name)
        except SafetensorError as err:
            raise CheckpointError(f"cannot read {name!r} from {self._where[name]}: {err}") from err

    def validate(self, spec: ModelSpec) -> None:
        """Check the key set, every shape exactly and the element types (floating point)
        against ``spec``.

        A tied model may also carry ``lm_head.weight`` (ignored). Rotary ``inv_freq``
        buffers saved by old transformers versions are ignored.

        Raises:
            CheckpointError: listing missing keys, extra keys, wrong shapes and
                non-floating-point tensors (int32 norm weights would load as integers).
        """
        expected = expected_hf_keys(spec)
        present = set(self.keys())
        ignorable = {k for k in present if k.endswith("rotary_emb.inv_freq")}
        if spec.tie_word_embeddings:
            ignorable.add(LM_HEAD)
        missing = [k for k in expected if k not in present]
        extra = sorted(present - set(expected) - ignorable)
        wrong = [f"{k}: {self.shape(k)} != expected {hf_shape(k, spec)}" for k in expected
                 if k in present and self.shape(k) != hf_shape(k, spec)]
        not_float = [f"{k}: {self.dtype(k)}" for k in expected if k in present and self.dtype(k) not in FLOAT_DTYPES]
        if spec.tie_word_embeddings and LM_HEAD in present and self.shape(LM_HEAD) != self.shape(EMBED):
            wrong.append(f"{LM_HEAD}: {self.shape(LM_HEAD)} != {EMBED} {self.shape(EMBED)}")
        problems = []
        if missing:
            problems.append(f"missing tensors ({len(missing)}): {_head(missing)}")
        if extra:
            problems.append(f"unexpected tensors ({len(extra)}): {_head(extra)}")
        if wrong:
            problems.append(f"wrong shapes ({len(wrong)}): {_head(wrong)}")
        if not_float:
            problems.append(f"not floating-point ({len(not_float)}): {_head(not_float)}")
        if problems:
            raise CheckpointError("HF checkpoint does not match its config: " + "; ".join(problems))


def _head(items: list[str], n: int = 8) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")


class HFShardWriter:
    """Stream tensors into safetensors shards of at most ``max_shard_bytes`` each.

    Writes ``model.safetensors`` when everything fits in one shard, otherwise
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``.
    """

    def __init__(self, directory: str | os.PathLike, max_shard_bytes: int = 2 * 1024**3):
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[str, list[str]]] = []  # (temp file name, keys)
        self.total_bytes = 0
        self.names: list[str] = []  # in the order added

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; flushes a shard when the size bound is reached."""
        if name in self.names:
            raise CheckpointError(f"tensor {name!r} written twice")
        self.names.append(name)
        num_bytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + num_bytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += num_bytes
        self.total_bytes += num_bytes

    def _flush(self) -> None:
        name = f"shard-{len(self._written):05d}.tmp.safetensors"
        save_file(self._pending, str(self.directory / name), metadata={"format": "pt"})
        self._written.append((name, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Flush, give shards their final names, write the index; returns the file names."""
        if self._pending or not self._written:
            self._flush()
        n = len(self._written)
        finals = [SAFE_SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                               for i in range(n)]
        weight_map = {}
        for (tmp, keys), final in zip(self._written, finals, strict=True):
            os.replace(self.directory / tmp, self.directory / final)
            weight_map.update(dict.fromkeys(keys, final))
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.directory / SAFE_INDEX).write_text(json.dumps(index, indent=2))
        return finals


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy the tokenizer/generation files that exist in ``src`` into ``dst``."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied



def read_hf_config(hf_dir: str | os.PathLike) -> dict:
    """``config.json`` of an HF directory as transformers interprets it (defaults filled)."""
    from transformers import AutoConfig

    config = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise CheckpointError(f"HF checkpoint directory {hf_dir} does not exist")
    if not config.is_file():
        raise CheckpointError(f"{hf_dir} has no config.json")
    try:
        fields = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config} is not valid JSON: {err}") from None
    if not isinstance(fields, dict):
        raise CheckpointError(f"{config} holds a JSON {type(fields).__name__}, not an object of config fields")
    try:
        return AutoConfig.from_pretrained(hf_dir, local_files_only=True).to_dict()
    except (OSError, ValueError, KeyError) as err:  # an unknown model_type, a bad field
        raise CheckpointError(f"{config}: transformers cannot read it: {err}") from None


def check_hf_dir(hf_dir: str | os.PathLike) -> tuple[dict, ModelSpec]:
    """The checks a conversion makes of an HF directory before it writes anything (the
    trainer's pre-start checks of ``model.path`` reuse them).

    Returns:
        ``(hf_config, spec)``: config.json as transformers reads it, and its ModelSpec.

    Raises:
        CheckpointError: no directory, no or invalid config.json, no safetensors files, an
            unreadable (truncated) file or index, missing/extra/mis-shaped tensors.
        UnsupportedModelError / ValueError: an architecture or feature megaflow does not map.
    """
    hf_config = read_hf_config(hf_dir)
    spec = ModelSpec.from_hf_config(hf_config)
    HFWeights(hf_dir).validate(spec)
    return hf_config, spec


__all__ = ["CheckpointError", "HFWeights", "HFShardWriter", "copy_tokenizer_files",
           "TOKENIZER_FILES", "read_hf_config", "check_hf_dir"]
