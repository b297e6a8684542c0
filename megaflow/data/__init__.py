"""Prompt data: verl-layout files, the prompt dataset, resumable loaders and tokenizers.

* :mod:`.io`: read/validate/write rows in verl's column layout (parquet, JSONL).
* :mod:`.dataset`: :class:`RLHFDataset` (chat template, left padding, over-long prompts)
  and :func:`collate_fn` (items -> :class:`~megaflow.protocol.DataProto`).
* :mod:`.loader`: :class:`PromptDataLoader`, deterministic per (seed, epoch) and resumable.
* :mod:`.tokenizer`: :func:`get_tokenizer` (``"arith"`` or a Hugging Face directory).
* :mod:`.arith`: the default recipe's arithmetic task and its character tokenizer.
* :mod:`.gsm8k_layout`: GSM8K JSONL -> verl layout (used by ``tools/prepare_gsm8k.py``).
"""
from megaflow.data.arith import ArithTaskConfig, build_arith_tokenizer, generate_arith_splits, write_arith_dataset
from megaflow.data.dataset import RLHFDataset, collate_fn
from megaflow.data.io import DatasetFormatError, PromptRecord, load_records, read_rows, write_rows
from megaflow.data.loader import PromptDataLoader, epoch_order
from megaflow.data.tokenizer import get_tokenizer

__all__ = [
    "ArithTaskConfig", "build_arith_tokenizer", "generate_arith_splits", "write_arith_dataset",
    "RLHFDataset", "collate_fn", "DatasetFormatError", "PromptRecord", "load_records", "read_rows",
    "write_rows", "PromptDataLoader", "epoch_order", "get_tokenizer",
]
