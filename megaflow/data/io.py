"""Reading and writing prompt datasets in verl's column layout (parquet and JSONL).

One row per prompt::

    {
      "data_source": "openai/gsm8k",                 # selects the rule reward
      "prompt": [{"role": "user", "content": "..."}], # chat messages
      "ability": "math",                              # optional, ignored
      "reward_model": {"style": "rule", "ground_truth": "72"},
      "extra_info": {"split": "train", "index": 0, ...},  # optional
    }

This is the layout verl's ``examples/data_preprocess`` scripts write, so their parquet
files load unchanged. A plain string is also accepted as ``prompt`` (one user message).
Every error names the file, the row and the column.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SUPPORTED_SUFFIXES = (".parquet", ".jsonl")


class DatasetFormatError(ValueError):
    """A prompt dataset file is malformed: the message names the file, row and column."""


@dataclass(frozen=True)
class PromptRecord:
    """One validated prompt row.

    ``location`` is a human-readable position used in error messages
    (``"<file>, row 12"``; JSONL rows also give their 1-based line number).
    """

    messages: list[dict[str, Any]]
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any]
    index: Any
    location: str
    reward_style: str | None = None


def read_rows(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """Read a parquet or JSONL file into ``[(location, row_dict), ...]``.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the suffix is neither ``.parquet`` nor ``.jsonl``.
        DatasetFormatError: invalid JSON, a row that is not an object, or an unreadable
            parquet file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt dataset file not found: {path}")
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    if path.suffix == ".parquet":
        return _read_parquet(path)
    raise ValueError(
        f"prompt dataset file {path}: unsupported suffix {path.suffix!r}; "
        f"expected one of {', '.join(SUPPORTED_SUFFIXES)}"
    )


def _read_jsonl(path: Path) -> list[tuple[str, dict[str, Any]]]:
    rows: list[tuple[str, dict[str, Any]]] = []
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            location = f"{path}, row {len(rows)} (line {lineno})"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetFormatError(
                    f"{location}: invalid JSON ({exc.msg} at column {exc.colno})"
                ) from exc
            if not isinstance(row, dict):
                raise DatasetFormatError(
                    f"{location}: expected a JSON object, got {type(row).__name__}"
                )
            rows.append((location, row))
    return rows


def _read_parquet(path: Path) -> list[tuple[str, dict[str, Any]]]:
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetFormatError(f"{path}: cannot read parquet file: {exc}") from exc
    return [(f"{path}, row {i}", row) for i, row in enumerate(table.to_pylist())]


def parse_record(
    location: str, row: dict[str, Any], *, prompt_key: str = "prompt", default_index: Any
) -> PromptRecord:
    """Validate one row of the verl layout and return it as a :class:`PromptRecord`.

    Required columns: ``prompt_key`` (list of ``{role, content}`` messages, or a string),
    ``data_source`` (non-empty string) and ``reward_model`` (an object with a
    ``ground_truth`` key, not null unless its ``style`` is ``"model"``). ``extra_info`` is optional;
    ``extra_info["index"]`` becomes the
    record's index when present, ``default_index`` otherwise.

    Raises:
        DatasetFormatError: naming ``location`` and the offending column.
    """
    for column in (prompt_key, "data_source", "reward_model"):
        if column not in row or row[column] is None:
            raise DatasetFormatError(
                f"{location}: missing column {column!r} (columns present: {sorted(row)})"
            )
    messages = _parse_messages(location, prompt_key, row[prompt_key])
    data_source = row["data_source"]
    if not isinstance(data_source, str) or not data_source:
        raise DatasetFormatError(
            f"{location}: column 'data_source' must be a non-empty string, got {data_source!r}"
        )
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise DatasetFormatError(
            f"{location}: column 'reward_model' must be an object with a 'ground_truth' key, "
            f"got {_short(reward_model)}"
        )
    if reward_model["ground_truth"] is None and reward_model.get("style") != "model":
        # A rule reward scores against the ground truth: a null one would fail in the
        # reward stage of the first step, after every process started.
        raise DatasetFormatError(
            f"{location}: column 'reward_model.ground_truth' is null (rule rewards need it; only "
            "rows with reward_model.style 'model' may leave it empty)"
        )
    extra_info = row.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise DatasetFormatError(
            f"{location}: column 'extra_info' must be an object, got {_short(extra_info)}"
        )
    index = extra_info.get("index")
    return PromptRecord(
        messages=messages,
        data_source=data_source,
        ground_truth=reward_model["ground_truth"],
        extra_info=extra_info,
        index=default_index if index is None else index,
        location=location,
        reward_style=reward_model.get("style"),
    )


def _parse_messages(location: str, column: str, value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, (list, tuple)) or len(value) == 0:
        raise DatasetFormatError(
            f"{location}: column {column!r} must be a non-empty list of chat messages "
            f"{{role, content}} or a string, got {_short(value)}"
        )
    for i, message in enumerate(value):
        ok = (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        )
        if not ok:
            raise DatasetFormatError(
                f"{location}: column {column!r}, message {i}: expected "
                f"{{'role': str, 'content': str}}, got {_short(message)}"
            )
    return [dict(m) for m in value]


def load_records(
    files: str | Path | Sequence[str | Path], *, prompt_key: str = "prompt"
) -> list[PromptRecord]:
    """Read and validate every row of one or more files, in file order then row order.

    Rows without ``extra_info.index`` get their global position as index.
    """
    paths = [files] if isinstance(files, (str, Path)) else list(files)
    if not paths:
        raise ValueError("no prompt dataset files given")
    records: list[PromptRecord] = []
    for path in paths:
        for location, row in read_rows(path):
            records.append(
                parse_record(location, row, prompt_key=prompt_key, default_index=len(records))
            )
    return records


def write_rows(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write rows in the verl layout to ``path`` (``.parquet`` or ``.jsonl``, by suffix).

    The file is written to a temporary name and renamed, so a reader never sees a
    partial file. Returns the path.
    """
    path = Path(path)
    rows = list(rows)
    if path.suffix not in SUPPORTED_SUFFIXES:
        raise ValueError(
            f"cannot write {path}: unsupported suffix {path.suffix!r}; "
            f"expected one of {', '.join(SUPPORTED_SUFFIXES)}"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    if path.suffix == ".parquet":
        pq.write_table(_rows_to_table(rows, path), tmp)
    else:
        with tmp.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


def _rows_to_table(rows: list[dict[str, Any]], path: Path) -> pa.Table:
    """Columns = union of the rows' keys (first-seen order); a row lacking one gets null."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    arrays = {}
    for column in columns:
        try:
            arrays[column] = pa.array([row.get(column) for row in rows])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise ValueError(f"cannot write {path}: column {column!r} has values of mixed types ({exc})") from exc
    return pa.table(arrays)


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
