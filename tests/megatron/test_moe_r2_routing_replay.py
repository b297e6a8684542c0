"""``actor.router_replay=R2`` in the engine: the old-log-prob forward (``record_routing``)
records the actor router's own top-k as ``old_routed_experts`` ``[batch, seq, layers, topk]``
(verl layout), and every forward of the update replays exactly that routing. Tiny Qwen3-MoE,
one 2-rank gloo world, at DP=2/EP=2 with fixed micro-batches (forward 1 row, update 3 rows),
token-budget micro-batches (EP=1) and PP=2:

* the recording is ``transformers``' own top-k expert set at every real token and layer
  (PP: each stage's layers reach the last stage);
* with the weights unchanged, the update's log-probs equal the recorded forward's;
* with the routers' weights perturbed between the two forwards (so that the router alone
  would route differently), the update's log-probs equal a forward that replays the
  recording through the R3 path (itself checked against ``transformers``), and differ from
  the perturbed router's own routing;
* an update batch without ``old_routed_experts`` is refused, naming it.
"""
from __future__ import annotations

import moe_testlib
import pytest
import torch
from megatron_testlib import VOCAB, make_batch

from megaflow.utils.launch import run_distributed

pytestmark = pytest.mark.slow

TEMPERATURE = 0.8
KEY = "old_routed_experts"
#: (name, overrides, forward micro-batch rows, update micro-batch rows; None: the token budget)
LAYOUTS = [("ep2", ["actor.ep=2"], 1, 3),
           ("budget", ["actor.use_dynamic_bsz=true", "actor.log_prob_max_token_len_per_gpu=32",
                       "actor.ppo_max_token_len_per_gpu=32"], None, None),
           ("pp2", ["actor.pp=2"], 2, 2)]


def _perturb_routers(model) -> None:
    """Add the same large noise to every router weight on every rank (the routers are replicated)."""
    g = torch.Generator().manual_seed(7)
    for m in model.modules():
        if getattr(m, "router_replay", None) is not None:
            m.weight.data += 3.0 * torch.randn(m.weight.shape, generator=g).to(m.weight.dtype)


def _update_log_probs(engine, rows, mbs):
    """The update's log-probs ``[rows, R]`` (in row order; None off the last stage), captured by
    the loss callback before the optimizer step."""
    captured = {}

    def loss_fn(outputs, mb, denominators):
        ids, keep = mb["row_id"].long().tolist(), mb["response_mask"].any(-1)
        for row, lp, kept in zip(ids, outputs["log_probs"], keep, strict=True):
            if kept:
                captured[row] = lp.detach().cpu()
        return (outputs["log_probs"] * mb["response_mask"]).sum() / denominators.num_tokens, {}

    engine.train_step(rows, loss_fn, temperature=TEMPERATURE, micro_batch_size=mbs)
    if not captured:
        return None
    return torch.stack([captured[i] for i in range(len(captured))])


def _layouts(rank, world, hf_dir, batch):
    from megaflow.megatron import parallel

    out = {}
    for name, overrides, forward_rows, update_rows in LAYOUTS:
        engine, info = moe_testlib.moe_actor_engine(
            hf_dir, ["actor.router_replay=R2", "actor.optim.lr_warmup_steps=0", *overrides], VOCAB)
        mine = {k: v.chunk(info.dp_size)[info.dp_rank] for k, v in batch.items()}
        mine["row_id"] = torch.arange(len(mine["input_ids"]), dtype=torch.float32)
        fwd = dict(temperature=TEMPERATURE, micro_batch_size=forward_rows)
        recorded = engine.forward(mine, record_routing=True, **fwd)
        box = [None if recorded is None else recorded[KEY]]  # the last stage's recording, to every stage
        if info.pp_size > 1:
            last = torch.distributed.get_process_group_ranks(info.pp_group)[-1]
            torch.distributed.broadcast_object_list(box, src=last, group=info.pp_group)
        routing = box[0]
        try:
            engine.train_step(mine, lambda *a: None)
        except ValueError as err:
            out[(name, "missing")] = str(err)
        with_routing = {**mine, KEY: routing}
        out[(name, "recorded")] = recorded
        out[(name, "unchanged_update")] = _update_log_probs(engine, with_routing, update_rows)
        _perturb_routers(engine.module)
        plain = engine.forward(mine, record_routing=True, **fwd)
        engine.router_replay = "R3"  # the R3 path: replay `routed_experts` in a forward (the reference)
        replayed = engine.forward({**mine, "routed_experts": routing}, **fwd)
        engine.router_replay = "R2"
        out[(name, "perturbed_plain")] = plain
        out[(name, "perturbed_replayed")] = replayed
        out[(name, "perturbed_update")] = _update_log_probs(engine, with_routing, update_rows)
        parallel.destroy_parallel()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("qwen3_moe_r2")
    _, batch, own = moe_testlib.saved_moe_case(hf_dir, make_batch(0), VOCAB)
    return run_distributed(_layouts, 2, str(hf_dir), batch, timeout_s=900), own, batch


def _cat(per_rank, key, field=None):
    parts = [r[key] if field is None else r[key][field] for r in per_rank if r[key] is not None]
    return torch.cat(parts)


def test_r2_records_the_routers_choice_and_the_update_replays_it(runs):
    """actor.router_replay=R2: compute_log_prob's recording, replayed by the update."""
    per_rank, own, batch = runs
    mask, real = batch["response_mask"], batch["attention_mask"].bool()
    for name, _, _, _ in LAYOUTS:
        routing = _cat(per_rank, (name, "recorded"), KEY)
        assert routing.shape == own.shape and routing.dtype == torch.int8
        assert torch.equal(routing.long().sort(-1).values[real], own.sort(-1).values[real]), name
        assert (routing[~real] == -1).all()
        recorded = _cat(per_rank, (name, "recorded"), "log_probs") * mask
        torch.testing.assert_close(_cat(per_rank, (name, "unchanged_update")) * mask, recorded, atol=1e-6, rtol=0)
        plain = _cat(per_rank, (name, "perturbed_plain"), KEY)
        changed = (plain.long().sort(-1).values != routing.long().sort(-1).values).any(-1)[real]
        assert changed.float().mean() > 0.2, name  # the perturbed routers alone route differently
        update = _cat(per_rank, (name, "perturbed_update")) * mask
        replayed = _cat(per_rank, (name, "perturbed_replayed"), "log_probs") * mask
        torch.testing.assert_close(update, replayed, atol=1e-6, rtol=0)
        assert (update - _cat(per_rank, (name, "perturbed_plain"), "log_probs") * mask).abs().max() > 1e-3
    assert all(KEY in r[(name, "missing")] for r in per_rank for name, _, _, _ in LAYOUTS)
