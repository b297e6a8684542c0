"""Expert shards through the streamed reshard: EP x TP x PP training layouts on 4 gloo ranks.

Every rank rebuilds the full synthetic experts from a seed (per layer and expert: gate, up,
down; a router), cuts its megatron-core training shard the way SequentialMLP holds it (local
experts ``ep_rank * E/ep ..`` of its stage, fc1 = [gate chunk; up chunk] of its TP rank, fc2
split along dim 1), streams the generation shard and compares every yielded tensor bit for
bit with the expert's TP = t_g shard of the full model, under its global layer and expert
index. The expert bytes each rank received must equal
``M_E / (t_g*p_g) - M_E / (ep*t*p)`` (:func:`~megaflow.topology.hybrid_layout.expert_sync_bytes_received`).
"""
from __future__ import annotations

import pytest
import torch

from megaflow.utils.launch import run_distributed

HIDDEN, INTER, EXPERTS, LAYERS = 8, 6, 4, 2


def _full(seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(LAYERS):
        out[f"L{layer}.router"] = torch.randn(EXPERTS, HIDDEN, generator=g)
        for e in range(EXPERTS):
            for key, shape in (("gate", (INTER, HIDDEN)), ("up", (INTER, HIDDEN)), ("down", (HIDDEN, INTER))):
                out[f"L{layer}.E{e}.{key}"] = torch.randn(*shape, generator=g)
    return out


def _expert_tensors(full, layer: int, expert: int, tp: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """fc1 / fc2 of one expert at TP ``tp`` rank ``tp_rank`` (megatron's layout, built by hand)."""
    def rows(t):
        return t.chunk(tp, dim=0)[tp_rank]
    gate, up, down = (full[f"L{layer}.E{expert}.{k}"] for k in ("gate", "up", "down"))
    return {"linear_fc1.weight": torch.cat([rows(gate), rows(up)]).clone(),
            "linear_fc2.weight": down.chunk(tp, dim=1)[tp_rank].clone()}


def _training_shard(full, *, tp, tp_rank, pp, pp_rank, ep, ep_rank):
    per_stage, per_rank = LAYERS // pp, EXPERTS // ep
    out = {}
    for local_layer in range(per_stage):
        layer = pp_rank * per_stage + local_layer
        out[f"decoder.layers.{local_layer}.mlp.router.weight"] = full[f"L{layer}.router"].clone()
        for local in range(per_rank):
            for key, t in _expert_tensors(full, layer, ep_rank * per_rank + local, tp, tp_rank).items():
                out[f"decoder.layers.{local_layer}.mlp.experts.local_experts.{local}.{key}"] = t
    return out


def _rank(rank, world_size, tp, pp, ep, gen_tp, gen_pp):
    from megaflow.hybrid_engine import MicroDPResharder, build_reshard_groups, plan_hybrid_layout

    dp = world_size // (tp * pp)
    layout = plan_hybrid_layout(tp, pp, dp, gen_tp, gen_pp, ep=ep)
    me = layout.ranks[rank]
    full = _full()
    params = _training_shard(full, tp=tp, tp_rank=me.tp_rank, pp=pp, pp_rank=me.pp_rank, ep=ep, ep_rank=me.ep_rank)
    resharder = MicroDPResharder(build_reshard_groups(layout), params)
    got = {name: pending.fetch().clone() for name, pending in resharder.stream_generation_tensors()}
    per_stage = LAYERS // gen_pp
    expected = {}
    for layer in range(me.gen_pp_rank * per_stage, (me.gen_pp_rank + 1) * per_stage):
        expected[f"decoder.layers.{layer}.mlp.router.weight"] = full[f"L{layer}.router"]
        for e in range(EXPERTS):
            for key, t in _expert_tensors(full, layer, e, gen_tp, me.gen_tp_rank).items():
                expected[f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{key}"] = t
    wrong = sorted(set(got) ^ set(expected))
    wrong += [n for n in expected if n in got and not torch.equal(got[n], expected[n])]
    return wrong, resharder.last_stats, sorted(resharder.generation_shapes()) == sorted(expected)


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp, ep, gen_tp, gen_pp", [(2, 1, 2, 1, 1), (1, 2, 2, 1, 1), (2, 1, 2, 2, 1)],
                         ids=["t2-ep2-tg1", "p2-ep2-pg1", "t2-ep2-tg2"])
def test_every_expert_arrives_whole_and_the_bytes_equal_the_formula(tp, pp, ep, gen_tp, gen_pp):
    from megaflow.topology.hybrid_layout import expert_sync_bytes_received, plan_hybrid_layout

    results = run_distributed(_rank, 4, tp, pp, ep, gen_tp, gen_pp, timeout_s=300)
    expert_bytes = sum(t.numel() * t.element_size() for k, t in _full().items() if ".E" in k)
    expected = expert_sync_bytes_received(plan_hybrid_layout(tp, pp, 4 // (tp * pp), gen_tp, gen_pp, ep=ep),
                                          expert_bytes)
    assert expected > 0
    for wrong, stats, names_agree in results:
        assert wrong == []
        assert names_agree
        assert stats.expert_bytes_received == expected


def test_expert_sync_formula_by_hand_and_ep_groups():
    from megaflow.topology.hybrid_layout import expert_sync_bytes_received, plan_hybrid_layout

    layout = plan_hybrid_layout(2, 2, 4, 1, 1, ep=2)  # t=2, p=2, d=4: 16 ranks
    # received = M/(t_g p_g) - M/(ep t p) = 800 - 800/8 = 700
    assert expert_sync_bytes_received(layout, 800) == 700
    assert expert_sync_bytes_received(plan_hybrid_layout(2, 1, 2, 2, 1, ep=1), 800) == 0  # nothing to move
    # ep groups: same tp rank and stage, dp ranks {0,1} and {2,3}, ordered by ep rank = dp_rank % ep
    for group in layout.ep_groups:
        members = [layout.ranks[r] for r in group]
        assert [m.ep_rank for m in members] == [0, 1]
        assert len({(m.tp_rank, m.pp_rank, m.dp_rank // 2) for m in members}) == 1
    assert sorted(r for g in layout.ep_groups for r in g) == list(range(16))
    assert layout.ranks[layout.rank_of(1, 0, 3)].ep_rank == 1
    with pytest.raises(ValueError, match="ep=3 must divide the data parallel size dp=4"):
        plan_hybrid_layout(1, 1, 4, 1, ep=3)
    with pytest.raises(ValueError, match="expert_bytes must be >= 0"):
        expert_sync_bytes_received(layout, -1)


def test_to_generation_refuses_expert_parallelism():
    """The gathered route holds only this rank's experts: refused with ep > 1, naming the streamed one."""
    from megaflow.hybrid_engine import MicroDPResharder, ReshardGroups, plan_hybrid_layout

    layout = plan_hybrid_layout(1, 1, 2, 1, ep=2)
    resharder = MicroDPResharder.__new__(MicroDPResharder)  # no world needed to reach the check
    resharder.layout, resharder._entries = layout, None
    resharder.groups = ReshardGroups(layout=layout, rank=0, gather=None, fold=None, gen_tp=None)
    with pytest.raises(ValueError, match="stream_generation_tensors"):
        resharder.to_generation()
