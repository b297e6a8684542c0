"""The arithmetic task: deterministic generator, correct labels, and its character tokenizer."""
import pytest

from megaflow.data import get_tokenizer, load_records
from megaflow.data.arith import ArithTaskConfig, generate_arith_splits, main, write_arith_dataset

VOCAB = ["<eos>", "<bos>", *"0123456789", "+", "-", "*", "="]


def test_default_task_is_the_small_learnable_one():
    cfg = ArithTaskConfig()
    assert (cfg.min_operand, cfg.max_operand, cfg.ops, cfg.max_answer) == (0, 4, ("+",), None)
    assert cfg.num_distinct_problems == 25
    assert ArithTaskConfig(ops=["+", "-"]).ops == ArithTaskConfig(ops="+-").ops == ("+", "-")  # from YAML


def test_generation_is_deterministic_per_seed():
    cfg = ArithTaskConfig(num_train=50, num_val=10, seed=4)
    assert generate_arith_splits(cfg) == generate_arith_splits(cfg)
    other = generate_arith_splits(ArithTaskConfig(num_train=50, num_val=10, seed=5))
    assert other["train"] != generate_arith_splits(cfg)["train"]


def test_rows_are_verl_layout_with_correct_labels():
    cfg = ArithTaskConfig(num_train=200, num_val=20, max_operand=12, ops=("+", "-", "*"), seed=1)
    splits = generate_arith_splits(cfg)
    assert len(splits["train"]) == 200 and len(splits["val"]) == 20
    for split, rows in splits.items():
        for i, row in enumerate(rows):
            assert row["data_source"] == "arith"
            assert row["extra_info"]["split"] == split and row["extra_info"]["index"] == i
            (message,) = row["prompt"]
            assert message["role"] == "user"
            a, op, b = row["extra_info"]["a"], row["extra_info"]["op"], row["extra_info"]["b"]
            assert message["content"] == f"{a}{op}{b}="
            expected = {"+": a + b, "-": a - b, "*": a * b}[op]
            assert row["reward_model"]["ground_truth"] == str(expected)
            assert expected >= 0 and 0 <= a <= 12 and 0 <= b <= 12


def test_validation_sampling_and_holdout():
    problems = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    held = generate_arith_splits(ArithTaskConfig(num_train=500, num_val=30, max_operand=9, holdout_val=True))
    assert len(problems(held["val"])) == 30
    assert not problems(held["val"]) & problems(held["train"])
    # default: validation covers (a sample of) the whole space, here all 25 problems
    small = generate_arith_splits(ArithTaskConfig(num_train=500, num_val=64, max_operand=4))
    assert problems(small["val"]) == {f"{a}+{b}=" for a in range(5) for b in range(5)}


def test_max_answer_limits_results():
    cfg = ArithTaskConfig(num_train=300, num_val=5, max_operand=9, max_answer=9)
    assert cfg.num_distinct_problems == 55  # pairs (a, b) in 0..9 with a + b <= 9
    rows = generate_arith_splits(cfg)["train"]
    assert max(int(r["reward_model"]["ground_truth"]) for r in rows) <= 9


def test_operand_digits_keep_only_operands_written_with_them():
    cfg = ArithTaskConfig(num_train=300, num_val=5, min_operand=111, max_operand=333, operand_digits="123")
    operands = [int(f"{x}{y}{z}") for x in "123" for y in "123" for z in "123"]  # 27, by hand
    assert cfg.num_distinct_problems == len(operands) ** 2 == 729
    for row in generate_arith_splits(cfg)["train"]:
        assert row["extra_info"]["a"] in operands and row["extra_info"]["b"] in operands
    # written unquoted in YAML or on the command line (operand_digits=123), the digits arrive as a number
    assert ArithTaskConfig(min_operand=111, max_operand=333, operand_digits=123).num_distinct_problems == 729


@pytest.mark.parametrize("kwargs,match", [
    ({"operand_digits": ""}, "operand_digits must be a non-empty string of decimal digits, got ''"),
    ({"operand_digits": "1a"}, "operand_digits must be a non-empty string of decimal digits, got '1a'"),
    ({"min_operand": 4, "max_operand": 9, "operand_digits": "123"}, r"no operand in \[4, 9\] is written only with"),
    ({"ops": ("/",)}, "ops must be a non-empty subset"),
    ({"min_operand": 5, "max_operand": 2}, "0 <= min_operand <= max_operand"),
    ({"num_train": 0}, "num_train must be >= 1"),
    ({"max_operand": 1, "num_val": 4, "holdout_val": True}, "leaves no training problems: only 4"),
    ({"min_operand": 5, "max_operand": 9, "max_answer": 3}, "no problem has a result <= max_answer=3"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithTaskConfig(**kwargs)


def test_written_files_load_as_records(tmp_path):
    paths = write_arith_dataset(tmp_path, ArithTaskConfig(num_train=8, num_val=3))
    assert set(paths) == {"train", "val"} and paths["train"].suffix == ".parquet"
    records = load_records(paths["train"])
    assert len(records) == 8 and records[0].data_source == "arith"
    main(["--out", str(tmp_path / "cli"), "--num-train", "5", "--num-val", "2", "--format", "jsonl"])
    assert len(load_records(tmp_path / "cli" / "train.jsonl")) == 5


def test_tokenizer_ids_and_round_trip():
    tok = get_tokenizer("arith")
    assert tok.vocab_size == len(tok) == 16
    assert tok.pad_token_id == tok.eos_token_id == 0 and tok.bos_token_id == 1
    assert tok.convert_ids_to_tokens(list(range(16))) == VOCAB
    text = "12+7=19"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == [VOCAB.index(c) for c in text]
    assert tok.encode(text) == [1] + ids  # BOS with special tokens
    assert tok.decode(ids) == text
    assert tok.decode([3, 11, 0, 0, 0]) == "19<eos><eos><eos>"
    assert tok.decode([3, 11, 0, 0], skip_special_tokens=True) == "19"
    assert tok.batch_decode([[3, 4], [5]]) == ["12", "3"]


def test_tokenizer_chat_template_and_save_load(tmp_path):
    tok = get_tokenizer("arith")
    messages = [{"role": "user", "content": "3+4="}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == "<bos>3+4="
    tok.save_pretrained(tmp_path)
    again = get_tokenizer(tmp_path)  # AutoTokenizer from the saved directory
    assert again.encode("3+4=") == tok.encode("3+4=")
    assert again.pad_token_id == again.eos_token_id == 0
    assert again.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == "<bos>3+4="


def test_get_tokenizer_missing_directory(tmp_path):
    with pytest.raises(OSError, match=r"tokenizer '.*nowhere' does not exist: .* or one of the built-in names 'arith', 'tool_arith'$"):
        get_tokenizer(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match=r"tokenizer '.*file' is a file, not a directory"):
        get_tokenizer(tmp_path / "file")
    with pytest.raises(OSError, match=r"tokenizer directory '.*' holds none of tokenizer.json"):
        get_tokenizer(tmp_path)
