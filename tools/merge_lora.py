#!/usr/bin/env python
"""Merge a Hugging Face PEFT LoRA adapter into a full HF checkpoint directory.

    python tools/merge_lora.py --base HF_DIR --adapter ADAPTER_DIR --out DIR [--overwrite]

Every adapted linear becomes ``W + (lora_alpha / r) B A`` (what peft's ``merge_and_unload`` computes); the other
tensors, ``config.json`` and the tokenizer files are copied. The output is safetensors, loadable with
``transformers.AutoModelForCausalLM.from_pretrained(OUT)``; on any error no output directory is left. The adapter is
e.g. one megaflow exported (:mod:`megaflow.models.peft_io`) or one trained with peft.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaflow.models.peft_io import merge_adapter_into_hf_dir
from megaflow.utils.cli import run_tool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="base model: HF checkpoint directory")
    parser.add_argument("--adapter", required=True, help="PEFT adapter directory (adapter_config.json + "
                                                         "adapter_model.safetensors)")
    parser.add_argument("--out", required=True, help="output HF directory")
    parser.add_argument("--max-shard-gb", type=float, default=2.0, help="safetensors shard size")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)
    # Expected errors (a missing or mis-shaped base, an adapter that does not fit it, an existing --out) are one
    # line and exit code 2. MEGAFLOW_DEBUG=1: traceback.
    return run_tool(lambda: _merge(args))


def _merge(args: argparse.Namespace) -> int:
    if not args.max_shard_gb > 0:
        raise ValueError(f"--max-shard-gb must be > 0, got {args.max_shard_gb}")
    start = time.monotonic()
    out = merge_adapter_into_hf_dir(args.base, args.adapter, args.out, overwrite=args.overwrite,
                                    max_shard_bytes=int(args.max_shard_gb * 1024**3))
    print(f"wrote merged HF checkpoint {out} in {time.monotonic() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
