#!/usr/bin/env python
"""Convert a Hugging Face Llama/Qwen2 checkpoint into a megaflow (megatron-core) checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir DIR --out DIR --tp N --pp M [--dtype bfloat16]

Starts tp*pp local gloo ranks; each builds its TP/PP shard of the model, fills it from
the safetensors files tensor by tensor and writes its part of a megatron-core distributed
checkpoint (loadable at any TP/PP later). The HF config and tokenizer files are kept in
OUT/hf/ for the way back (tools/convert_megatron_to_hf.py). Key sets and shapes are
checked exactly before any rank starts; on any error no output directory is left behind.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaflow.models.convert import DTYPES, convert_hf_to_megatron
from megaflow.utils.cli import run_tool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, help="HF checkpoint directory (safetensors)")
    parser.add_argument("--out", required=True, help="output megaflow checkpoint directory")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                        help="parameter dtype of the checkpoint")
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
    start = time.monotonic()
    out = convert_hf_to_megatron(args.hf_dir, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype,
                                 overwrite=args.overwrite, timeout_s=args.timeout_s)
    print(f"wrote megaflow checkpoint {out} (tp={args.tp}, pp={args.pp}, {args.dtype}) in "
          f"{time.monotonic() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
