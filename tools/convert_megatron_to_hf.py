#!/usr/bin/env python
"""Convert a megaflow (megatron-core) checkpoint back into a Hugging Face directory.

    python tools/convert_megatron_to_hf.py --ckpt DIR --out DIR [--tp N --pp M] [--dtype bfloat16]

Writes safetensors shards (+ index), config.json (tie flag preserved, padding rows
removed) and the tokenizer files kept in CKPT/hf/, loadable with
``transformers.AutoModelForCausalLM.from_pretrained(OUT)``. The checkpoint is read by
tp*pp local ranks (default 1: the whole model in one process) and gathered tensor by
tensor; names and shapes are checked exactly; on any error no output directory is left.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaflow.models.convert import DTYPES, convert_megatron_to_hf
from megaflow.utils.cli import run_tool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, help="megaflow checkpoint directory")
    parser.add_argument("--out", required=True, help="output HF directory")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size used to read")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size used to read")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                        help="dtype of the written tensors (default: the checkpoint's)")
    parser.add_argument("--max-shard-gb", type=float, default=2.0, help="safetensors shard size")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="limit for the ranks")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # Expected errors (bad sizes, missing/extra/mis-shaped/truncated tensors, corrupt
    # metadata, an existing or impossible --out) are one line and exit code 2; they are
    # all found before any rank starts or anything is written. MEGAFLOW_DEBUG=1: traceback.
    return run_tool(lambda: _convert(args))


def _convert(args: argparse.Namespace) -> int:
    for flag in ("tp", "pp"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if not args.max_shard_gb > 0:
        raise ValueError(f"--max-shard-gb must be > 0, got {args.max_shard_gb}")
    start = time.monotonic()
    out = convert_megatron_to_hf(args.ckpt, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype,
                                 overwrite=args.overwrite,
                                 max_shard_bytes=int(args.max_shard_gb * 1024**3),
                                 timeout_s=args.timeout_s)
    print(f"wrote HF checkpoint {out} in {time.monotonic() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
