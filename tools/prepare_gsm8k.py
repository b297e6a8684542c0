#!/usr/bin/env python
"""GSM8K JSONL -> verl-layout parquet for the GSM8K recipes.

    python tools/prepare_gsm8k.py --out data/gsm8k            # from the project copy
    python tools/prepare_gsm8k.py --src DIR --out DIR [--format jsonl]

``--src`` holds ``train.jsonl`` and ``test.jsonl`` with ``question``/``answer`` (the
layout of github.com/openai/grade-school-math); the default is the project copy in
``megaflow/data/gsm8k`` (MIT). Each prompt is the question followed by the instruction
"Let's think step by step and output the final answer after '####'."; the ground truth
is the number after ``####`` in the answer.
"""
from __future__ import annotations

import argparse
import sys

from megaflow.data.gsm8k_layout import GSM8K_DEFAULT_DIR, prepare_gsm8k
from megaflow.data.io import read_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GSM8K JSONL -> verl-layout parquet")
    parser.add_argument("--src", default=str(GSM8K_DEFAULT_DIR), help="directory with train.jsonl and test.jsonl")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    args = parser.parse_args(argv)
    try:
        paths = prepare_gsm8k(args.src, args.out, suffix=f".{args.format}")
    except (OSError, ValueError) as exc:
        print(f"prepare_gsm8k: error: {exc}", file=sys.stderr)
        return 1
    for split, path in paths.items():
        print(f"{split}: {len(read_rows(path))} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
