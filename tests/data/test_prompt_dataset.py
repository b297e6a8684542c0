"""RLHFDataset: chat template, left padding, over-long prompts, collate -> DataProto."""
import numpy as np
import pytest
import torch

from conftest import TINY_ID, build_tiny_tokenizer, make_row
from megaflow.data import RLHFDataset, collate_fn, get_tokenizer, write_rows
from megaflow.data.io import DatasetFormatError
from megaflow.protocol import DataProto


def expected_ids(row):
    """Token ids of a row under the tiny chat template, computed word by word."""
    words = []
    for m in row["prompt"]:
        words += [f"<|{m['role']}|>"] + m["content"].split()
    return [TINY_ID[w] for w in words + ["<|assistant|>"]]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_items_are_templated_and_left_padded(tmp_path, tiny_tokenizer, toy_rows, suffix):
    path = write_rows(toy_rows, tmp_path / f"p{suffix}")
    ds = RLHFDataset(path, tiny_tokenizer, max_prompt_length=10)
    assert len(ds) == 5 and ds.num_filtered_overlong == 0
    for i, row in enumerate(toy_rows):
        item, ids = ds[i], expected_ids(row)
        num_pad = 10 - len(ids)
        assert item["input_ids"].tolist() == [TINY_ID["<pad>"]] * num_pad + ids
        assert item["attention_mask"].tolist() == [0] * num_pad + [1] * len(ids)
        assert item["position_ids"].tolist() == [0] * num_pad + list(range(len(ids)))
        assert item["input_ids"].dtype == item["attention_mask"].dtype == torch.int64
        assert item["raw_prompt"] == row["prompt"]
        assert item["data_source"] == row["data_source"]
        assert item["ground_truth"] == row["reward_model"]["ground_truth"]
        assert item["extra_info"] == row["extra_info"]
        assert item["index"] == row["extra_info"]["index"]


def test_overlong_prompts_are_filtered_and_counted(tmp_path, tiny_tokenizer, toy_rows, caplog):
    # Templated lengths: 4, 6, 3, 8, 8 tokens (user + words + assistant [+ system + words]).
    lengths = [len(expected_ids(r)) for r in toy_rows]
    assert lengths == [4, 6, 3, 8, 8]
    path = write_rows(toy_rows, tmp_path / "p.parquet")
    with caplog.at_level("WARNING"):
        ds = RLHFDataset(path, tiny_tokenizer, max_prompt_length=6)
    assert ds.num_rows_read == 5 and ds.num_filtered_overlong == 2 and len(ds) == 3
    assert [ds[i]["index"] for i in range(3)] == [10, 11, 12]
    assert "filtered 2 of 5 prompts longer than max_prompt_length=6" in caplog.text
    assert ds[1]["attention_mask"].tolist() == [1] * 6  # exactly max length: kept, no padding


def test_overlong_error_mode_names_file_and_row(tmp_path, tiny_tokenizer, toy_rows):
    path = write_rows(toy_rows, tmp_path / "p.jsonl")
    with pytest.raises(ValueError, match=r"p.jsonl, row 3 \(line 4\): prompt of 8 tokens exceeds "
                                         r"max_prompt_length=7"):
        RLHFDataset(path, tiny_tokenizer, max_prompt_length=7, overlong_prompts="error")


def test_everything_filtered_is_an_error(tmp_path, tiny_tokenizer, toy_rows):
    path = write_rows(toy_rows, tmp_path / "p.jsonl")
    with pytest.raises(ValueError, match="all 5 prompts are longer than max_prompt_length=2"):
        RLHFDataset(path, tiny_tokenizer, max_prompt_length=2)


def test_bad_arguments(tmp_path, tiny_tokenizer, toy_rows):
    path = write_rows(toy_rows, tmp_path / "p.jsonl")
    with pytest.raises(ValueError, match="overlong_prompts must be one of"):
        RLHFDataset(path, tiny_tokenizer, max_prompt_length=8, overlong_prompts="truncate")
    with pytest.raises(ValueError, match="max_prompt_length must be >= 1"):
        RLHFDataset(path, tiny_tokenizer, max_prompt_length=0)
    no_template = build_tiny_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="no chat template; pass use_chat_template=False"):
        RLHFDataset(path, no_template, max_prompt_length=8)


def test_raw_prompt_path_without_chat_template(tmp_path, tiny_tokenizer, toy_rows):
    ds = RLHFDataset(write_rows(toy_rows, tmp_path / "p.jsonl"), tiny_tokenizer, max_prompt_length=8,
                     use_chat_template=False)
    # system "be brief" and user "a b c" joined by a newline -> 5 words, no role tokens.
    assert ds[4]["input_ids"].tolist() == [0, 0, 0] + [TINY_ID[w] for w in "be brief a b c".split()]


def test_max_samples(tmp_path, tiny_tokenizer, toy_rows):
    ds = RLHFDataset(write_rows(toy_rows, tmp_path / "p.jsonl"), tiny_tokenizer, max_prompt_length=8,
                     max_samples=2)
    assert len(ds) == 2 and ds.num_rows_read == 2


def test_untokenizable_prompt_names_row(tmp_path, toy_rows):
    arith = get_tokenizer("arith")  # has no unknown token: words are not in its vocabulary
    rows = [make_row("1+2="), make_row("3+4="), make_row("hello")]
    with pytest.raises(DatasetFormatError, match=r"p.jsonl, row 2 \(line 3\): cannot tokenize column 'prompt'"):
        RLHFDataset(write_rows(rows, tmp_path / "p.jsonl"), arith, max_prompt_length=8)


def test_arith_tokenizer_pad_equals_eos(tmp_path):
    tok = get_tokenizer("arith")
    rows = [make_row("12+7=", ground_truth="19", data_source="arith"), make_row("3+4=", ground_truth="7")]
    ds = RLHFDataset(write_rows(rows, tmp_path / "a.parquet"), tok, max_prompt_length=8)
    vocab = {t: i for i, t in enumerate(["<eos>", "<bos>", *"0123456789", "+", "-", "*", "="])}
    item = ds[1]
    assert item["input_ids"].tolist() == [0, 0, 0, vocab["<bos>"], vocab["3"], vocab["+"], vocab["4"], vocab["="]]
    # pad id == eos id == 0: the mask, not the ids, says what is padding.
    assert item["attention_mask"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert item["position_ids"].tolist() == [0, 0, 0, 0, 1, 2, 3, 4]
    assert ds[0]["attention_mask"].sum() == 6


def test_collate_builds_dataproto(tmp_path, tiny_tokenizer, toy_rows):
    ds = RLHFDataset(write_rows(toy_rows, tmp_path / "p.jsonl"), tiny_tokenizer, max_prompt_length=9)
    batch = collate_fn([ds[i] for i in (3, 0, 4)])
    assert isinstance(batch, DataProto) and len(batch) == 3
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert batch.batch[key].shape == (3, 9)
        assert torch.equal(batch.batch[key][1], ds[0][key])
    nt = batch.non_tensor_batch
    assert set(nt) == {"raw_prompt", "data_source", "ground_truth", "extra_info", "index"}
    assert all(v.dtype == object and v.shape == (3,) for v in nt.values())
    assert nt["raw_prompt"][2] == toy_rows[4]["prompt"]  # list of 2 messages stays one object
    assert list(nt["ground_truth"]) == ["d", "a", "e"] and list(nt["index"]) == [13, 10, 14]
    # survives DataProto operations
    sub = batch[np.array([2, 0])]
    assert list(sub.non_tensor_batch["index"]) == [14, 13]


def test_collate_rejects_mismatched_items():
    with pytest.raises(ValueError, match="no items"):
        collate_fn([])
    with pytest.raises(ValueError, match="item 1 has keys"):
        collate_fn([{"a": torch.zeros(2)}, {"b": torch.zeros(2)}])


def test_empty_file_is_an_error(tmp_path, tiny_tokenizer):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match=r"contain no rows: .*empty.jsonl"):
        RLHFDataset(path, tiny_tokenizer, max_prompt_length=8)
