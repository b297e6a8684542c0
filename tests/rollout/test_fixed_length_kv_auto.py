"""rollout.ignore_eos (no stop ids) and rollout.cpu_kv_cache_auto (KV cache sized from the step)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megaflow.dryrun.memory import cpu_kv_cache_bytes, kv_cache_bytes_for_batch
from megaflow.topology import load_run
from megaflow.trainer.roles import eos_token_ids
from megaflow.workers.actor_rollout import stop_token_ids

TOK = SimpleNamespace(eos_token_id=[0, 5], pad_token_id=0)


def test_ignore_eos_drops_every_stop_id():
    eos = eos_token_ids(TOK)
    assert eos == (0, 5) and eos_token_ids(SimpleNamespace(eos_token_id=7)) == (7,)
    assert stop_token_ids(load_run("tiny_arith_grpo"), eos) == (0, 5)
    assert stop_token_ids(load_run("tiny_arith_grpo", ["rollout.ignore_eos=true"]), eos) == ()


def test_kv_auto_off_keeps_the_fixed_gib():
    cfg = load_run("tiny_arith_grpo", ["rollout.cpu_kv_cache_gib=3"])
    assert cpu_kv_cache_bytes(cfg) == 3 * 2**30


def test_kv_auto_matches_a_hand_computation():
    # tiny recipe: 16 prompts x n=8 = 128 samples; actor t=2, t_g=1 -> 2 replicas -> 64 samples each;
    # sequences 16 + 4 = 20 tokens -> 1 block of 128 each -> 64 blocks, + ceil(6.4) = 7 margin -> 71 blocks;
    # one block: 128 tokens x 2 (K, V) x 2 layers x 2 KV heads x head_dim 128/4=32 x 4 bytes = 131072 bytes.
    cfg = load_run("tiny_arith_grpo", ["rollout.cpu_kv_cache_auto=true"])
    assert cpu_kv_cache_bytes(cfg) == 71 * 131072 == 9306112


def test_kv_formula_tp_and_multi_block_sequences():
    # 3 sequences of 300 tokens -> 3 blocks each = 9, + ceil(0.9) = 1 -> 10 blocks;
    # one block at t_g=2: 128 x 2 x 4 layers x (4/2) heads x 32 x 2 bytes = 131072.
    got = kv_cache_bytes_for_batch(samples=3, max_seq_len=300, num_layers=4, num_kv_heads=4, head_dim=32,
                                   dtype_bytes=2, gen_tp=2)
    assert got == 10 * 128 * 2 * 4 * 2 * 32 * 2
    # 30 blocks x 0.1 is 3.0000000000000004 in floats: the margin is 3 blocks, not 4
    assert kv_cache_bytes_for_batch(samples=30, max_seq_len=128, num_layers=1, num_kv_heads=1, head_dim=1,
                                    dtype_bytes=1) == 33 * 128 * 2
    assert kv_cache_bytes_for_batch(samples=1, max_seq_len=1, num_layers=1, num_kv_heads=1, head_dim=1,
                                    dtype_bytes=1, margin=0.0) == 2 * 128 * 2


@pytest.mark.parametrize("bad, match", [(dict(samples=0), "samples"), (dict(gen_tp=3), "gen_tp=3"),
                                        (dict(margin=-0.1), "margin"), (dict(head_dim=True), "head_dim")])
def test_kv_formula_refuses_bad_sizes(bad, match):
    args = dict(samples=2, max_seq_len=10, num_layers=2, num_kv_heads=4, head_dim=8, dtype_bytes=4, gen_tp=1)
    with pytest.raises(ValueError, match=match):
        kv_cache_bytes_for_batch(**{**args, **bad})


def test_new_keys_are_typed():
    from megaflow.config.typed import ConfigError

    with pytest.raises(ConfigError, match="rollout.ignore_eos"):
        load_run("tiny_arith_grpo", ["rollout.ignore_eos=maybe"])
