"""Tokenizer loading: the built-in arithmetic tokenizer or a Hugging Face tokenizer directory."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Names that :func:`get_tokenizer` builds in-process instead of loading from disk.
BUILTIN_TOKENIZERS = ("arith", "tool_arith")
#: Files of which a Hugging Face tokenizer directory holds at least one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _builtin_names() -> str:
    """``the built-in name 'arith'`` (or ``one of the built-in names 'a', 'b'``) for error messages."""
    names = ", ".join(repr(n) for n in BUILTIN_TOKENIZERS)
    return f"the built-in name {names}" if len(BUILTIN_TOKENIZERS) == 1 else f"one of the built-in names {names}"


def get_tokenizer(name_or_path: str | Path, *, trust_remote_code: bool = False, **kwargs: Any):
    """Return the tokenizer named by a recipe's ``model.tokenizer``.

    ``"arith"`` gives :func:`megaflow.data.arith.build_arith_tokenizer`, ``"tool_arith"``
    :func:`megaflow.data.tool_arith.build_tool_arith_tokenizer`; anything else is
    loaded with ``transformers.AutoTokenizer.from_pretrained(name_or_path, **kwargs)``
    (a local directory, ``~`` expanded: there is no model hub access). A tokenizer without a pad
    token gets ``pad_token = eos_token`` (as verl does); code downstream never tells
    padding from EOS by id, so pad == eos is safe.

    Raises:
        OSError: the directory does not exist or holds no tokenizer (path named).
        ValueError: the tokenizer has neither a pad nor an EOS token.
    """
    if str(name_or_path) == "arith":
        from megaflow.data.arith import build_arith_tokenizer

        return build_arith_tokenizer()
    if str(name_or_path) == "tool_arith":
        from megaflow.data.tool_arith import build_tool_arith_tokenizer

        return build_tool_arith_tokenizer()
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        # Checked here: transformers would take the name for a hub repo id and answer with
        # a long chain of hub errors (there is no hub access).
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise OSError(f"tokenizer {str(name_or_path)!r} {what}: pass a local Hugging Face model/tokenizer "
                      f"directory or {_builtin_names()}")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise OSError(f"tokenizer directory {str(name_or_path)!r} holds none of {', '.join(TOKENIZER_FILES)}")
    from transformers import AutoTokenizer

    kwargs.setdefault("local_files_only", True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as exc:
        raise OSError(
            f"cannot load a tokenizer from {str(name_or_path)!r}: {exc}. Pass a local Hugging Face "
            f"model/tokenizer directory or {_builtin_names()}"
        ) from exc
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {str(name_or_path)!r} has neither a pad token nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
        logger.warning("tokenizer %s has no pad token; using its EOS token %r", name_or_path, tokenizer.eos_token)
    return tokenizer
