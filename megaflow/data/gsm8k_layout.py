"""GSM8K JSONL (``question``/``answer``) -> prompt rows in verl's layout.

The rows match verl's ``examples/data_preprocess/gsm8k.py`` (``data_source
"openai/gsm8k"``, the same instruction, ``reward_model.ground_truth`` = the number after
``####`` without thousands separators), so recipes and rewards are interchangeable.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megaflow.data.gsm8k_answer import parse_ground_truth
from megaflow.data.io import DatasetFormatError, write_rows

GSM8K_DATA_SOURCE = "openai/gsm8k"
#: The project copy of GSM8K (MIT license, see ``gsm8k/LICENSE``).
GSM8K_DEFAULT_DIR = Path(__file__).resolve().parent / "gsm8k"
GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after '####'."
GSM8K_SPLITS = ("train", "test")


def gsm8k_row(question: str, answer: str, *, split: str, index: int) -> dict[str, Any]:
    """One verl-layout row; ``ValueError`` if ``answer`` has no ``#### <number>``."""
    return {
        "data_source": GSM8K_DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": parse_ground_truth(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def read_gsm8k_jsonl(path: str | Path, split: str) -> list[dict[str, Any]]:
    """Convert one GSM8K JSONL file to rows.

    Raises:
        FileNotFoundError: missing file.
        DatasetFormatError: invalid JSON, missing ``question``/``answer``, or an answer
            without ``#### <number>`` (file and line named).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K file not found: {path}")
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                record = json.loads(line)
                question, answer = record["question"], record["answer"]
                rows.append(gsm8k_row(question, answer, split=split, index=len(rows)))
            except json.JSONDecodeError as exc:
                raise DatasetFormatError(f"{where}: invalid JSON ({exc.msg})") from exc
            except (KeyError, TypeError) as exc:
                raise DatasetFormatError(f"{where}: expected an object with 'question' and 'answer'") from exc
            except ValueError as exc:
                raise DatasetFormatError(f"{where}: column 'answer': {exc}") from exc
    return rows


def prepare_gsm8k(src: str | Path = GSM8K_DEFAULT_DIR, out: str | Path = "data/gsm8k", *,
                  suffix: str = ".parquet",
                  transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> dict[str, Path]:
    """Write ``out/train.parquet`` and ``out/test.parquet`` from ``src/{train,test}.jsonl``
    (each row passed through ``transform`` when given, e.g. to add tools).

    Every split is read and checked before anything is written, and each file is written
    under a temporary name then renamed, so a bad line anywhere leaves ``out`` as it was.

    Raises:
        FileNotFoundError / DatasetFormatError: see :func:`read_gsm8k_jsonl`.
        OSError: ``out`` cannot be created (a parent is a file or not writable).
    """
    from megaflow.utils.paths import why_not_creatable

    src, out = Path(src), Path(out)
    rows = {split: read_gsm8k_jsonl(src / f"{split}.jsonl", split) for split in GSM8K_SPLITS}
    if transform is not None:
        rows = {split: [transform(row) for row in split_rows] for split, split_rows in rows.items()}
    problem = why_not_creatable(out)
    if problem is not None:
        raise OSError(f"cannot create output directory {out}: {problem}")
    return {split: write_rows(rows[split], out / f"{split}{suffix}") for split in GSM8K_SPLITS}
