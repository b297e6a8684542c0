"""Fixtures for the data tests: a tiny offline Hugging Face tokenizer and verl-layout rows."""
import pytest

#: Word-level vocabulary of the tiny tokenizer; ids are positions in this list.
TINY_VOCAB = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|system|>", "<|assistant|>",
              "hello", "world", "what", "is", "two", "plus", "three", "be", "brief", "a", "b", "c"]
TINY_ID = {w: i for i, w in enumerate(TINY_VOCAB)}
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_tokenizer(pad_equals_eos: bool = False):
    """A word-level ``PreTrainedTokenizerFast`` with a chat template, built in-process."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(dict(TINY_ID), unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>",
        pad_token="<eos>" if pad_equals_eos else "<pad>",
        additional_special_tokens=["<|user|>", "<|system|>", "<|assistant|>"],
    )
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


def make_row(content, *, index=None, data_source="toy", ground_truth="5", system=None):
    """A verl-layout row (``extra_info.index`` only when ``index`` is given)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": content}]
    row = {"data_source": data_source, "prompt": messages, "ability": "toy",
           "reward_model": {"style": "rule", "ground_truth": ground_truth},
           "extra_info": {"split": "train"}}
    if index is not None:
        row["extra_info"]["index"] = index
    return row


@pytest.fixture
def toy_rows():
    """Five prompts of known word lengths (user content words: 2, 4, 1, 6, 3)."""
    return [
        make_row("hello world", index=10, ground_truth="a"),
        make_row("what is two plus", index=11, ground_truth="b"),
        make_row("hello", index=12, ground_truth="c", data_source="toy2"),
        make_row("what is two plus three hello", index=13, ground_truth="d"),
        make_row("a b c", index=14, ground_truth="e", system="be brief"),
    ]
