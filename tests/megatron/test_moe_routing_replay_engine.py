"""``actor.router_replay=R3`` in the engine: every forward routes each token through the
batch field ``routed_experts`` ``[batch, seq, moe_layers, topk]`` (verl layout, one entry per
position of ``input_ids``), split with the tokens by left alignment, micro-batches, token-budget
micro-batches, EP and PP. Tiny Qwen3-MoE, one 2-rank gloo world:

* replaying ``transformers``' own top-k routing gives ``transformers``' log-probs (1e-5), so
  the field reaches each layer at the right tokens;
* a drifted routing (every id + 1 mod E) moves the log-probs, identically at DP=2/EP=2 with
  micro-batches of 1 and 3 rows, with token-budget micro-batches (EP=1), and at PP=2;
* a batch without the field is refused, naming it.
"""
from __future__ import annotations

import moe_testlib
import pytest
import torch
from megatron_testlib import VOCAB, hf_reference, make_batch

from megaflow.utils.launch import run_distributed

pytestmark = pytest.mark.slow

TEMPERATURE = 0.8
#: (name, overrides, forward micro-batch rows or None for the token budget)
LAYOUTS = [("ep2_mb1", ["actor.ep=2"], 1), ("ep2_mb3", ["actor.ep=2"], 3),
           ("budget", ["actor.use_dynamic_bsz=true", "actor.log_prob_max_token_len_per_gpu=32"], None),
           ("pp2", ["actor.pp=2"], 2)]


def _layouts(rank, world, hf_dir, batch, routings):
    """Each layout's log-probs per routing; the rows are split so that the two DP ranks' longest
    rows differ (13 and 10 tokens, the fixture's row order), so EP=2 needs the engine's common width."""
    from megaflow.megatron import parallel

    out = {}
    for name, overrides, rows in LAYOUTS:
        engine, info = moe_testlib.moe_actor_engine(hf_dir, ["actor.router_replay=R3", *overrides], VOCAB)
        for kind, routed in routings.items():
            rows_of_rank = {k: v.chunk(info.dp_size)[info.dp_rank] for k, v in {**batch, "routed_experts": routed}.items()}
            result = engine.forward(rows_of_rank, temperature=TEMPERATURE, micro_batch_size=rows)
            out[(name, kind)] = None if result is None else result["log_probs"]
        try:
            engine.forward({k: v.chunk(info.dp_size)[info.dp_rank] for k, v in batch.items()}, micro_batch_size=2)
        except ValueError as err:
            out[(name, "missing")] = str(err)
        parallel.destroy_parallel()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("qwen3_moe")
    hf, batch, own = moe_testlib.saved_moe_case(hf_dir, make_batch(0), VOCAB)
    with torch.no_grad():
        reference = hf_reference(hf, batch, TEMPERATURE)["log_probs"] * batch["response_mask"]
    routings = {"own": own.to(torch.int16), "drifted": ((own + 1) % moe_testlib.NUM_EXPERTS).to(torch.int16)}
    return run_distributed(_layouts, 2, str(hf_dir), batch, routings, timeout_s=900), reference, batch


def _log_probs(per_rank, key):
    return torch.cat([r[key] for r in per_rank if r[key] is not None])


def test_replaying_the_engine_routing_reproduces_transformers_and_splits_with_the_tokens(runs):
    """actor.router_replay=R3 with routed_experts in the batch."""
    per_rank, reference, batch = runs
    mask = batch["response_mask"]
    for name, _, _ in LAYOUTS:
        torch.testing.assert_close(_log_probs(per_rank, (name, "own")) * mask, reference, atol=1e-5, rtol=0)
    drifted = _log_probs(per_rank, ("ep2_mb1", "drifted")) * mask
    assert (drifted - reference).abs().max() > 1e-3
    for name in ("ep2_mb3", "budget", "pp2"):
        torch.testing.assert_close(_log_probs(per_rank, (name, "drifted")) * mask, drifted, atol=1e-6, rtol=0)
    assert all("routed_experts" in r[(name, "missing")] for r in per_rank for name, _, _ in LAYOUTS)
