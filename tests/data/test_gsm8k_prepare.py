"""tools/prepare_gsm8k.py on the project copy of GSM8K."""
import importlib.util
import json
from pathlib import Path

import pytest

from megaflow.data import load_records
from megaflow.data.gsm8k_layout import GSM8K_DEFAULT_DIR, GSM8K_INSTRUCTION, read_gsm8k_jsonl
from megaflow.data.io import DatasetFormatError

REPO = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("prepare_gsm8k", REPO / "tools" / "prepare_gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_project_copy_keeps_its_license():
    assert "MIT License" in (GSM8K_DEFAULT_DIR / "LICENSE").read_text()
    assert {p.name for p in GSM8K_DEFAULT_DIR.glob("*.jsonl")} == {"train.jsonl", "test.jsonl"}


def test_tool_writes_verl_layout_parquet(tmp_path, capsys):
    assert _tool().main(["--out", str(tmp_path)]) == 0
    assert "train: 7473 rows" in capsys.readouterr().out
    test = load_records(tmp_path / "test.parquet")
    source = [json.loads(line) for line in (GSM8K_DEFAULT_DIR / "test.jsonl").read_text().splitlines()]
    assert len(test) == len(source) == 1319
    for record, raw in zip(test[:50], source[:50]):
        assert record.data_source == "openai/gsm8k"
        assert record.messages == [{"role": "user", "content": f"{raw['question']} {GSM8K_INSTRUCTION}"}]
        # label: the text after "####", thousands separators removed (as verl does)
        assert record.ground_truth == raw["answer"].split("####")[-1].strip().replace(",", "")
        assert record.extra_info["answer"] == raw["answer"] and record.extra_info["split"] == "test"
    assert [r.index for r in test[:3]] == [0, 1, 2]
    with_commas = [r for r, raw in zip(test, source) if "," in raw["answer"].split("####")[-1]]
    assert with_commas and all("," not in r.ground_truth for r in with_commas)


def test_bad_source_rows_are_named(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "a\n#### 4"}) + "\n"
                                     + json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    with pytest.raises(DatasetFormatError, match=r"train.jsonl, line 2: column 'answer': .*no '#### <number>'"):
        read_gsm8k_jsonl(src / "train.jsonl", "train")
    (src / "train.jsonl").write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(DatasetFormatError, match=r"line 1: expected an object with 'question' and 'answer'"):
        read_gsm8k_jsonl(src / "train.jsonl", "train")


def test_tool_reports_missing_source(tmp_path, capsys):
    assert _tool().main(["--src", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: GSM8K file not found") and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_bad_line_in_test_split_writes_nothing(tmp_path, capsys):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "a\n#### 4"}) + "\n")
    (src / "test.jsonl").write_text(json.dumps({"question": "q", "answer": "a\n#### 5"}) + "\n{broken\n")
    assert _tool().main(["--src", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: {src / 'test.jsonl'}, line 2: invalid JSON" in err and "Traceback" not in err
    assert not out.exists()  # train.parquet was valid but is not written either


def test_output_under_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert _tool().main(["--out", str(tmp_path / "file" / "gsm8k")]) == 2
    assert f"{tmp_path / 'file'} is not a directory" in capsys.readouterr().err
