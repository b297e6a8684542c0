#!/usr/bin/env python
"""GSM8K JSONL -> verl-layout parquet for the GSM8K recipes.

    python tools/prepare_gsm8k.py --out data/gsm8k            # from the project copy
    python tools/prepare_gsm8k.py --src DIR --out DIR [--format jsonl]
    python tools/prepare_gsm8k.py --out data/gsm8k_tool --tools calculator   # multi-turn tool rows

``--src`` holds ``train.jsonl`` and ``test.jsonl`` with ``question``/``answer`` (the
layout of github.com/openai/grade-school-math); the default is the project copy in
``megaflow/data/gsm8k`` (MIT). Each prompt is the question followed by the instruction
"Let's think step by step and output the final answer after '####'."; the ground truth
is the number after ``####`` in the answer.

``--tools NAME[,NAME]`` writes rows for multi-turn rollouts (``rollout.agent``) in verl's
layout: the tools in ``extra_info.tools_kwargs`` and, because SmolLM2's chat template ignores
the tool specs, their description and the call format as a system message
(:func:`megaflow.agent.system_prompt.tool_system_prompt`). Those rows are JSONL (parquet
cannot store the tools' empty ``create_kwargs``).
"""
from __future__ import annotations

import argparse
import sys

from megaflow.data.gsm8k_layout import GSM8K_DEFAULT_DIR, prepare_gsm8k
from megaflow.data.io import read_rows
from megaflow.utils.cli import run_tool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GSM8K JSONL -> verl-layout parquet")
    parser.add_argument("--src", default=str(GSM8K_DEFAULT_DIR), help="directory with train.jsonl and test.jsonl")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--format", choices=["parquet", "jsonl"], default=None,
                        help="default: parquet, jsonl with --tools")
    parser.add_argument("--tools", default=None,
                        help="comma-separated registered tools (e.g. calculator): multi-turn tool rows")
    args = parser.parse_args(argv)
    if args.tools is not None and args.format == "parquet":
        parser.error("--tools writes JSONL (parquet cannot store the empty create_kwargs); drop --format parquet")
    # Expected errors (a missing file, a bad line, an impossible --out) are one line and
    # exit code 2, found before anything is written (MEGAFLOW_DEBUG=1: traceback).
    return run_tool(lambda: _prepare(args))


def _prepare(args: argparse.Namespace) -> int:
    transform = None
    if args.tools is not None:
        from megaflow.agent.system_prompt import tool_system_prompt, with_tool_system_prompt

        names = [name.strip() for name in args.tools.split(",") if name.strip()]
        system = tool_system_prompt(names)  # ValueError (one line, exit 2) for an unknown tool

        def transform(row: dict) -> dict:
            return with_tool_system_prompt(row, names, system)
    suffix = args.format or ("jsonl" if args.tools is not None else "parquet")
    paths = prepare_gsm8k(args.src, args.out, suffix=f".{suffix}", transform=transform)
    for split, path in paths.items():
        print(f"{split}: {len(read_rows(path))} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
