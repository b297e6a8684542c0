"""Each training run scores with its own reward table: building a second run's reward in
the same process neither wraps the format reward twice nor leaks custom scorers."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import megaflow.rewards.arith as arith
from megaflow.rewards import RewardTable, get_reward_spec, known_data_sources
from megaflow.rewards.format import format_reward

PATTERN = r"<answer>.*</answer>"
TEXT, TRUTH = "<answer>7</answer>", "7"  # wrong layout for arith (score 0), right for the format (1)


def _cfg(format_weight, functions=None):
    return SimpleNamespace(reward=SimpleNamespace(format_weight=format_weight, format_pattern=PATTERN,
                                                  reward_kwargs={}, functions=functions or {}))


def test_two_runs_in_one_process_do_not_interfere():
    from megaflow.trainer.main import build_reward_fn

    registry_before = {s: get_reward_spec(s) for s in known_data_sources()}
    base = arith.compute_score(TEXT, TRUTH)["score"]
    fmt = format_reward(TEXT, PATTERN)
    assert (base, fmt) == (0.0, 1.0)  # so one wrap and two wraps give different scores
    expected = 0.8 * base + 0.2 * fmt  # (1 - w) * base + w * format, w = 0.2
    first = build_reward_fn(_cfg(0.2), tokenizer=None, functions={"custom/src": lambda s, gt, extra=None: 0.5})
    second = build_reward_fn(_cfg(0.2), tokenizer=None, functions={})
    for manager in (first, second):
        assert manager.table.spec("arith").fn(TEXT, TRUTH)["score"] == pytest.approx(expected)
        assert manager.table.spec("arith").skip_special_tokens is False
    assert first.table.spec("custom/src").fn("x", None)["score"] == pytest.approx(0.8 * 0.5)
    with pytest.raises(ValueError, match="no rule reward registered for data_source 'custom/src'"):
        second.table.spec("custom/src")
    plain = build_reward_fn(_cfg(0.0), tokenizer=None, functions={})
    assert plain.table.spec("arith").fn is arith.compute_score
    # the process registry is what it was
    assert {s: get_reward_spec(s) for s in known_data_sources()} == registry_before


def test_table_is_read_only_and_derivations_are_new_tables():
    table = RewardTable.registered()
    with pytest.raises(TypeError):
        table.specs["arith"] = None
    wrapped = table.with_format_reward(PATTERN, 0.5)
    assert wrapped is not table and table.spec("arith").fn is get_reward_spec("arith").fn
    assert wrapped.spec("arith").fn(TEXT, TRUTH)["score"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="format_weight must be in"):
        table.with_format_reward(PATTERN, 1.5)
