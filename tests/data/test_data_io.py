"""Reading verl-layout files: both formats agree, and every error names file, row and column."""
import json

import pytest

from conftest import make_row
from megaflow.data.io import DatasetFormatError, load_records, read_rows, write_rows


def _write_jsonl(path, rows_or_lines):
    with open(path, "w") as f:
        for item in rows_or_lines:
            f.write((item if isinstance(item, str) else json.dumps(item)) + "\n")
    return path


def test_jsonl_and_parquet_give_the_same_records(tmp_path, toy_rows):
    jsonl = write_rows(toy_rows, tmp_path / "p.jsonl")
    parquet = write_rows(toy_rows, tmp_path / "p.parquet")
    a, b = load_records(jsonl), load_records(parquet)
    assert [r.messages for r in a] == [r.messages for r in b] == [row["prompt"] for row in toy_rows]
    assert [r.ground_truth for r in a] == ["a", "b", "c", "d", "e"]
    assert [r.data_source for r in b] == ["toy", "toy", "toy2", "toy", "toy"]
    assert [r.index for r in b] == [10, 11, 12, 13, 14]
    assert all(r.reward_style == "rule" for r in a)
    assert not list(tmp_path.glob(".*.tmp"))  # atomic write left no temp file


def test_index_defaults_to_position_across_files(tmp_path):
    f1 = write_rows([make_row("hello"), make_row("world")], tmp_path / "a.jsonl")
    f2 = write_rows([make_row("what")], tmp_path / "b.parquet")
    records = load_records([f1, f2])
    assert [r.index for r in records] == [0, 1, 2]
    assert records[2].location.startswith(str(f2)) and "row 0" in records[2].location


def test_plain_string_prompt_is_one_user_message(tmp_path):
    row = make_row("x")
    row["prompt"] = "hello world"
    (record,) = load_records(write_rows([row], tmp_path / "s.jsonl"))
    assert record.messages == [{"role": "user", "content": "hello world"}]


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_records(tmp_path / "nope.parquet")


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("a,b\n")
    with pytest.raises(ValueError, match=r"data.csv.*'\.csv'.*\.parquet, \.jsonl"):
        read_rows(path)


def test_invalid_json_names_file_row_and_line(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [make_row("hello"), "", '{"prompt": [oops'])
    with pytest.raises(DatasetFormatError, match=r"bad.jsonl, row 1 \(line 3\): invalid JSON"):
        read_rows(path)


@pytest.mark.parametrize("drop", ["prompt", "data_source", "reward_model"])
def test_missing_column_is_named(tmp_path, drop):
    rows = [make_row("hello"), make_row("world")]
    del rows[1][drop]
    path = write_rows(rows, tmp_path / "m.jsonl")
    with pytest.raises(DatasetFormatError, match=rf"m.jsonl, row 1 \(line 2\): missing column '{drop}'"):
        load_records(path)


def test_missing_column_in_parquet(tmp_path):
    rows = [make_row("hello"), make_row("world")]
    for r in rows:
        del r["data_source"]
    path = write_rows(rows, tmp_path / "m.parquet")
    with pytest.raises(DatasetFormatError, match=r"m.parquet, row 0: missing column 'data_source'"):
        load_records(path)


@pytest.mark.parametrize("column,value,fragment", [
    ("prompt", [], "column 'prompt' must be a non-empty list"),
    ("prompt", [{"role": "user"}], "column 'prompt', message 0"),
    ("prompt", [{"role": "user", "content": 3}], "column 'prompt', message 0"),
    ("data_source", "", "column 'data_source' must be a non-empty string"),
    ("reward_model", {"style": "rule"}, "column 'reward_model' must be an object with a 'ground_truth'"),
    ("extra_info", [1, 2], "column 'extra_info' must be an object"),
])
def test_malformed_values_are_named(tmp_path, column, value, fragment):
    rows = [make_row("hello"), make_row("hello"), make_row("world")]
    rows[2][column] = value
    path = write_rows(rows, tmp_path / "v.jsonl")
    with pytest.raises(DatasetFormatError, match=r"v.jsonl, row 2 \(line 3\): ") as info:
        load_records(path)
    assert fragment in str(info.value)


def test_custom_prompt_key(tmp_path):
    row = make_row("hello")
    row["messages"] = row.pop("prompt")
    (record,) = load_records(write_rows([row], tmp_path / "k.jsonl"), prompt_key="messages")
    assert record.messages[0]["content"] == "hello"
    with pytest.raises(DatasetFormatError, match="missing column 'prompt'"):
        load_records(tmp_path / "k.jsonl")


def test_unreadable_parquet(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(DatasetFormatError, match="broken.parquet: cannot read parquet"):
        read_rows(path)


def test_parquet_keeps_columns_missing_from_the_first_row(tmp_path):
    rows = [make_row("hello"), make_row("world")]
    rows[1]["ability"] = None
    rows[0].pop("ability")
    rows[1]["extra_info"]["note"] = "x"
    path = write_rows(rows, tmp_path / "u.parquet")
    back = [row for _, row in read_rows(path)]
    assert back[0]["ability"] is None and back[1]["ability"] is None
    assert back[1]["extra_info"] == {"split": "train", "note": "x"}
    assert back[0]["extra_info"] == {"split": "train", "note": None}


def test_parquet_mixed_types_are_named(tmp_path):
    rows = [make_row("hello", ground_truth="1"), make_row("world")]
    rows[1]["reward_model"] = "oops"
    with pytest.raises(ValueError, match=r"u.parquet: column 'reward_model' has values of mixed types"):
        write_rows(rows, tmp_path / "u.parquet")


def test_null_ground_truth_is_refused_naming_the_row(tmp_path):
    rows = [make_row("1+1=", ground_truth="2"), make_row("1+2=", ground_truth=None)]
    path = write_rows(rows, tmp_path / "d.jsonl")
    with pytest.raises(DatasetFormatError, match=r"d.jsonl, row 1 \(line 2\): column 'reward_model.ground_truth' is null"):
        load_records(path)
    model_style = dict(rows[1], reward_model={"style": "model", "ground_truth": None})
    assert load_records(write_rows([model_style], tmp_path / "m.jsonl"))[0].ground_truth is None
