"""Tokenizer loading: the built-in arithmetic tokenizer or a Hugging Face tokenizer directory."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Names that :func:`get_tokenizer` builds in-process instead of loading from disk.
BUILTIN_TOKENIZERS = ("arith",)


def get_tokenizer(name_or_path: str | Path, *, trust_remote_code: bool = False, **kwargs: Any):
    """Return the tokenizer named by a recipe's ``model.tokenizer``.

    ``"arith"`` gives :func:`megaflow.data.arith.build_arith_tokenizer`; anything else is
    loaded with ``transformers.AutoTokenizer.from_pretrained(name_or_path, **kwargs)``
    (a local directory here: there is no model hub access). A tokenizer without a pad
    token gets ``pad_token = eos_token`` (as verl does); code downstream never tells
    padding from EOS by id, so pad == eos is safe.

    Raises:
        OSError: the directory does not exist or holds no tokenizer (path named).
        ValueError: the tokenizer has neither a pad nor an EOS token.
    """
    if str(name_or_path) == "arith":
        from megaflow.data.arith import build_arith_tokenizer

        return build_arith_tokenizer()
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path), trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as exc:
        raise OSError(
            f"cannot load a tokenizer from {str(name_or_path)!r}: {exc}. Pass a local Hugging Face "
            f"model/tokenizer directory or one of the built-in names {BUILTIN_TOKENIZERS}"
        ) from exc
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {str(name_or_path)!r} has neither a pad token nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
        logger.warning("tokenizer %s has no pad token; using its EOS token %r", name_or_path, tokenizer.eos_token)
    return tokenizer
