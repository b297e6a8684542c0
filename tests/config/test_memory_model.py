"""The planner's memory model against an exact account of a real megatron-core actor
(one rank, via tools/bench_memory.py's measurement) and against hand counts."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from toolslib import load_tool  # noqa: E402

from megaflow.dryrun.memory import rollout_memory  # noqa: E402
from megaflow.topology.model_spec import model_spec  # noqa: E402

SMALL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 16}


def test_generation_shard_keeps_the_training_vocab_padding_by_hand():
    spec = model_spec(SMALL)
    # t=2 pads the vocab to 256 rows, t_g=1 would pad to 128: the gathered shard has 256 rows
    layer = 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64 + 3 * 64 * 128 + 2 * 64
    full = 4 * layer + 256 * 64 * 2 + 64  # embedding + untied output (256 rows each) + final norm
    train = 4 * (layer - 2 * 64) // 2 + 4 * 2 * 64 + 128 * 64 * 2 + 64
    mem = rollout_memory(spec, train_tp=2, train_pp=1, gen_tp=1, gen_pp=1, dtype="float32", seq=8,
                         samples_per_replica=1, engine_budget=None, cpu_kv_cache=1.0)
    assert mem.weights == full * 4 and mem.extra_weights == (full - train) * 4
    aliased_nothing = rollout_memory(spec, train_tp=2, train_pp=1, gen_tp=1, gen_pp=1, dtype="float32", seq=8,
                                     samples_per_replica=1, engine_budget=None, cpu_kv_cache=1.0,
                                     params_in_buffer=True)
    assert aliased_nothing.extra_weights == full * 4


@pytest.mark.slow
def test_planner_matches_the_exact_account_of_one_rank():
    bench = load_tool("bench_memory")
    for case in (bench.Case("one-rank-none", world=1), bench.Case("one-rank-selective", world=1,
                                                                  recompute="selective")):
        plan, meas = bench.planned(case), bench.measured(case, timeout_s=300)
        for term in ("params", "grads", "optimizer", "gen_weights", "gen_extra", "kv_cache"):
            assert plan[term] == pytest.approx(meas[term], rel=0.05, abs=1), (case.name, term)
        assert plan["layer_activations"] == pytest.approx(meas["layer_activations"], rel=0.25), case.name
        assert meas["params"] > 0 and meas["optimizer"] == pytest.approx(2 * meas["params"], rel=1e-3)
