"""The default recipe's task: small-integer arithmetic learned from scratch.

A prompt is ``"<bos>3+4="`` and the expected response is ``"7<eos>"``. The task exists so
that a tiny randomly initialised model shows RL learning on a 2-core CPU in minutes:

* a character-level tokenizer of 16 tokens (``<eos>``, ``<bos>``, digits, ``+ - * =``), so
  a random policy emits a digit with probability 10/16 and stops with 1/16 per token,
  so well-formed answers (``"7<eos>"``) appear by chance in ~8% of samples with a
  4-token response limit (sum over k = 1..3 digits of (10/16)^k / 16);
* a graded rule reward (:mod:`megaflow.rewards.arith`): 0 unless the response is a
  number terminated by ``<eos>``; 1 for the exact answer; otherwise a format credit plus a
  closeness credit. A random policy therefore scores a small but non-zero mean with
  variance inside every GRPO group, and the reward rises as the model first learns the
  format, then the magnitude, then the exact sum;
* ``pad == eos`` on purpose (as in SmolLM2 and many chat models), so every consumer is
  exercised on that pitfall.

The tokenizer is a real ``transformers`` fast tokenizer (a ``tokenizers`` WordLevel model
with one token per character and a chat template), so it has the whole Hugging Face
interface: ``encode``/``decode``/``batch_decode``, ``apply_chat_template``,
``pad_token_id``/``eos_token_id``/``bos_token_id``, ``save_pretrained``.

Rows are written in verl's layout (``data_source="arith"``), see :mod:`megaflow.data.io`.
Run ``python -m megaflow.data.arith --out DIR`` to write ``train.parquet``/``val.parquet``.
"""
from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARITH_DATA_SOURCE = "arith"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
OPERATORS = ("+", "-", "*")
# Token ids: <eos>=0 (also the pad id), <bos>=1, "0".."9"=2..11, "+"=12, "-"=13, "*"=14, "="=15.
ARITH_VOCAB: tuple[str, ...] = (EOS_TOKEN, BOS_TOKEN, *"0123456789", *OPERATORS, "=")
# Renders the concatenated message contents after <bos>; roles carry no tokens and the
# generation prompt is empty (the prompt already ends with "=").
ARITH_CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_arith_tokenizer():
    """Return the arithmetic task's character-level tokenizer.

    A ``transformers.PreTrainedTokenizerFast`` with vocabulary :data:`ARITH_VOCAB`
    (``vocab_size == 16``), ``pad_token == eos_token == "<eos>"`` (id 0), ``bos_token ==
    "<bos>"`` (id 1). ``encode(text)`` prepends ``<bos>`` (``add_special_tokens=True``),
    ``decode`` joins characters without spaces, and ``apply_chat_template(messages,
    add_generation_prompt=True, tokenize=False)`` gives ``"<bos>" + contents``.
    Deterministic; built in-process (no files, no network).

    Encoding a character outside the vocabulary raises an exception from ``tokenizers``
    (there is no unknown token on purpose: such text is not part of the task).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(ARITH_VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        padding_side="left",
        model_max_length=64,
    )
    tokenizer.chat_template = ARITH_CHAT_TEMPLATE
    return tokenizer


@dataclass(frozen=True)
class ArithTaskConfig:
    """Parameters of the generated arithmetic dataset.

    The problem space is every ``a op b`` with ``min_operand <= a, b <= max_operand``
    and, when ``max_answer`` is set, ``result <= max_answer``; for ``-`` the operands
    are ordered so the result is non-negative. Training rows are drawn uniformly with
    replacement from the training pool. The validation split holds ``num_val`` distinct
    problems (all of them when ``num_val`` exceeds the space): a sample of the whole
    space by default (the task is memorisable, so validation measures what was learned),
    or problems held out of the training pool with ``holdout_val=True``. With
    ``operand_digits`` set (a string of decimal digits, e.g. ``"123"``), only the operands in
    range whose decimal digits all belong to it are used (111..333 with ``"123"``: 27 operands).
    """

    num_train: int = 4096  # training rows (sampled with replacement from the train pool)
    num_val: int = 64  # distinct validation problems
    min_operand: int = 0
    max_operand: int = 4  # 0..4 + 0..4: 25 problems, one-digit answers (learnable in minutes)
    max_answer: int | None = None  # e.g. 9: only single-digit results
    ops: tuple[str, ...] = ("+",)
    holdout_val: bool = False  # validation problems never appear in training
    operand_digits: str | None = None  # e.g. "123": only operands written with these digits
    seed: int = 0

    def __post_init__(self) -> None:
        # YAML gives a list (["+"]) or a string ("+-"): store a tuple either way.
        object.__setattr__(self, "ops", tuple(self.ops))
        if isinstance(self.operand_digits, int) and not isinstance(self.operand_digits, bool):
            object.__setattr__(self, "operand_digits", str(self.operand_digits))  # YAML reads 123 as a number
        if self.num_train < 1 or self.num_val < 0:
            raise ValueError(
                f"num_train must be >= 1 and num_val >= 0, got {self.num_train}, {self.num_val}"
            )
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(
                "operands must satisfy 0 <= min_operand <= max_operand, "
                f"got min_operand={self.min_operand}, max_operand={self.max_operand}"
            )
        digits = self.operand_digits
        if digits is not None and (not digits or not set(digits) <= set("0123456789")):
            raise ValueError(f"operand_digits must be a non-empty string of decimal digits, got {digits!r}")
        bad = [op for op in self.ops if op not in OPERATORS]
        if not self.ops or bad:
            raise ValueError(f"ops must be a non-empty subset of {OPERATORS}, got {self.ops!r}")
        if self.num_distinct_problems == 0:
            if self.operand_digits is not None:
                raise ValueError(f"no operand in [{self.min_operand}, {self.max_operand}] is written only with the "
                                 f"digits operand_digits={self.operand_digits!r} (or no result <= max_answer)")
            raise ValueError(f"no problem has a result <= max_answer={self.max_answer}")
        if self.holdout_val and self.num_val >= self.num_distinct_problems:
            raise ValueError(
                f"holdout_val with num_val={self.num_val} leaves no training problems: only "
                f"{self.num_distinct_problems} distinct problems with operands in "
                f"[{self.min_operand}, {self.max_operand}], ops {self.ops}, max_answer {self.max_answer}"
            )

    @property
    def num_distinct_problems(self) -> int:
        return len(_all_problems(self))


def arith_answer(a: int, op: str, b: int) -> int:
    """The exact result of ``a op b``; raises ValueError for an unknown operator."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}; expected one of {OPERATORS}")


def _all_problems(config: ArithTaskConfig) -> list[tuple[int, str, int]]:
    operands = [n for n in range(config.min_operand, config.max_operand + 1)
                if config.operand_digits is None or set(str(n)) <= set(config.operand_digits)]
    problems = set()
    for op in config.ops:
        for a in operands:
            for b in operands:
                problem = (max(a, b), op, min(a, b)) if op == "-" else (a, op, b)
                if config.max_answer is None or arith_answer(*problem) <= config.max_answer:
                    problems.add(problem)
    return sorted(problems)


def make_arith_row(a: int, op: str, b: int, *, split: str, index: int) -> dict[str, Any]:
    """One verl-layout row for the problem ``a op b``."""
    return {
        "data_source": ARITH_DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(arith_answer(a, op, b))},
        "extra_info": {"split": split, "index": index, "a": a, "b": b, "op": op},
    }


def generate_arith_splits(config: ArithTaskConfig = ArithTaskConfig(), *,
                          make_row: Callable[..., dict[str, Any]] = make_arith_row) -> dict[str, list[dict]]:
    """Generate ``{"train": rows, "val": rows}`` deterministically from ``config.seed``
    (``make_row(a, op, b, split=, index=)`` writes a row: :func:`make_arith_row`, or the agent
    task's :func:`megaflow.data.tool_arith.make_tool_arith_row`)."""
    rng = random.Random(config.seed)
    problems = _all_problems(config)
    rng.shuffle(problems)
    val = problems[: config.num_val]
    pool = problems[config.num_val :] if config.holdout_val else problems
    train_rows = [
        make_row(*rng.choice(pool), split="train", index=i) for i in range(config.num_train)
    ]
    val_rows = [make_row(*p, split="val", index=i) for i, p in enumerate(val)]
    return {"train": train_rows, "val": val_rows}


def write_arith_dataset(
    out_dir: str | Path, config: ArithTaskConfig = ArithTaskConfig(), *, suffix: str = ".parquet",
    make_row: Callable[..., dict[str, Any]] = make_arith_row,
) -> dict[str, Path]:
    """Write ``train`` and ``val`` files (``.parquet`` or ``.jsonl``) to ``out_dir``.

    Returns ``{"train": path, "val": path}``. Generation is deterministic, so calling it
    again with the same config rewrites identical files.
    """
    from megaflow.data.io import write_rows

    out_dir = Path(out_dir)
    return {
        split: write_rows(rows, out_dir / f"{split}{suffix}")
        for split, rows in generate_arith_splits(config, make_row=make_row).items()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--num-train", type=int, default=ArithTaskConfig.num_train)
    parser.add_argument("--num-val", type=int, default=ArithTaskConfig.num_val)
    parser.add_argument("--min-operand", type=int, default=ArithTaskConfig.min_operand)
    parser.add_argument("--max-operand", type=int, default=ArithTaskConfig.max_operand)
    parser.add_argument("--max-answer", type=int, default=None)
    parser.add_argument("--holdout-val", action="store_true")
    parser.add_argument("--ops", default="+", help="operators, e.g. '+-'")
    parser.add_argument("--seed", type=int, default=ArithTaskConfig.seed)
    parser.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    args = parser.parse_args(argv)
    config = ArithTaskConfig(
        num_train=args.num_train,
        num_val=args.num_val,
        min_operand=args.min_operand,
        max_operand=args.max_operand,
        max_answer=args.max_answer,
        ops=tuple(args.ops),
        holdout_val=args.holdout_val,
        seed=args.seed,
    )
    for split, path in write_arith_dataset(args.out, config, suffix=f".{args.format}").items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
