"""Layout planner of the 3D-HybridEngine: hand-checked small layouts, large-world invariants.

Ranks follow megatron-core's default order tp-cp-ep-dp-pp: rank = tp + t*(dp + d*pp).
"""
import itertools

import pytest

from megaflow.topology.hybrid_layout import plan_hybrid_layout, reshard_cost


# --- hand-checked layouts ----------------------------------------------------------------

def test_hybridflow_figure_16_ranks_t4_p2_d2_to_tg2():
    # t=4 p=2 d=2: training TP blocks [0..3] [4..7] (pp 0), [8..11] [12..15] (pp 1).
    layout = plan_hybrid_layout(4, 2, 2, gen_tp=2)
    assert (layout.micro_dp, layout.gen_dp) == (4, 8)
    # generation TP groups: stride t/t_g = 2 inside each training TP block
    assert sorted(layout.gen_tp_groups) == [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11),
                                            (12, 14), (13, 15)]
    # micro-DP: consecutive pairs in the TP block, extended over the 2 PP stages
    assert layout.micro_dp_groups == ((0, 1, 8, 9), (2, 3, 10, 11), (4, 5, 12, 13),
                                      (6, 7, 14, 15))
    assert layout.gather_groups == ((0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11),
                                    (12, 13), (14, 15))
    assert layout.fold_groups == tuple((r, r + 8) for r in range(8))
    # replica = dp*4 + (pp%2)*2 + tp%2 ; gen tp = tp // 2
    assert [p.gen_dp_rank for p in layout.ranks] == [0, 1, 0, 1, 4, 5, 4, 5,
                                                    2, 3, 2, 3, 6, 7, 6, 7]
    assert [p.gen_tp_rank for p in layout.ranks] == [0, 0, 1, 1] * 4
    assert [p.rank for p in layout.ranks if p.is_collect] == [0, 1, 4, 5, 8, 9, 12, 13]
    # vLLM sees replica-major, gen-TP-minor ranks: consecutive pairs = generation TP groups
    assert layout.vllm_rank_order == (0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15)
    assert layout.gen_tp_groups == tuple(layout.vllm_rank_order[i:i + 2] for i in range(0, 16, 2))


def test_16_ranks_keep_two_generation_stages():
    layout = plan_hybrid_layout(4, 2, 2, gen_tp=2, gen_pp=2)
    assert (layout.micro_dp, layout.gen_dp) == (2, 4)
    assert sorted(layout.micro_dp_groups) == sorted(layout.gather_groups)  # no folding
    assert layout.fold_groups == tuple((r,) for r in range(16))
    # index = replica * p_g + gen stage
    assert layout.gen_tp_groups == ((0, 2), (8, 10), (1, 3), (9, 11), (4, 6), (12, 14),
                                    (5, 7), (13, 15))
    assert layout.gen_pp_groups == ((0, 8), (2, 10), (1, 9), (3, 11), (4, 12), (6, 14),
                                    (5, 13), (7, 15))
    assert [p.rank for p in layout.ranks if p.is_collect] == [8, 9, 12, 13]
    assert layout.vllm_rank_order == (0, 2, 8, 10, 1, 3, 9, 11, 4, 6, 12, 14, 5, 7, 13, 15)


def test_paper_8_ranks_t4_d2():
    layout = plan_hybrid_layout(4, 1, 2, gen_tp=2)
    assert sorted(layout.gen_tp_groups) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert layout.micro_dp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert [p.gen_dp_rank for p in layout.ranks] == [0, 1, 0, 1, 2, 3, 2, 3]


def test_4_ranks_t2_p2_to_tg2_and_tg1():
    tg2 = plan_hybrid_layout(2, 2, 1, gen_tp=2)
    assert tg2.gen_tp_groups == ((0, 1), (2, 3))
    assert tg2.micro_dp_groups == ((0, 2), (1, 3))
    assert tg2.gather_groups == ((0,), (1,), (2,), (3,))
    assert [p.gen_dp_rank for p in tg2.ranks] == [0, 0, 1, 1]
    assert [p.is_collect for p in tg2.ranks] == [True, False, True, False]
    tg1 = plan_hybrid_layout(2, 2, 1, gen_tp=1)
    assert tg1.micro_dp_groups == ((0, 1, 2, 3),)
    assert tg1.gather_groups == ((0, 1), (2, 3)) and tg1.fold_groups == ((0, 2), (1, 3))
    assert [p.gen_dp_rank for p in tg1.ranks] == [0, 1, 2, 3]
    assert all(p.is_collect for p in tg1.ranks)


def test_cost_model_by_hand():
    cost = reshard_cost(plan_hybrid_layout(4, 2, 2, gen_tp=2), model_bytes=1600)
    # (8 - 2) / (2 * 8) * 1600 = 600 ; peak 1600 / 2 ; naive 7/8 * 1600 ; shard 1600/8
    assert (cost.micro_dp_bytes, cost.micro_dp_peak_bytes) == (600, 800)
    assert (cost.naive_bytes, cost.naive_peak_bytes, cost.training_bytes) == (1400, 1600, 200)
    assert cost.communication_ratio == pytest.approx(1400 / 600)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tp=4, pp=1, dp=1, gen_tp=3), "t % t_g"),
    (dict(tp=2, pp=4, dp=1, gen_tp=1, gen_pp=3), "p % p_g"),
    (dict(tp=2, pp=1, dp=1, gen_tp=2, num_attention_heads=3), "num_attention_heads=3"),
    (dict(tp=4, pp=1, dp=1, gen_tp=2, num_attention_heads=8, num_query_groups=2),
     "num_query_groups=2 is not divisible by training tp=4"),
    (dict(tp=4, pp=1, dp=1, gen_tp=4, num_query_groups=2), "num_query_groups=2 .* generation tp=4"),
    (dict(tp=0, pp=1, dp=1, gen_tp=1), "tp must be >= 1"),
])
def test_invalid_layouts_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_hybrid_layout(**kwargs)


def test_non_int_size_raises_type_error():
    with pytest.raises(TypeError, match="gen_tp must be an int"):
        plan_hybrid_layout(2, 1, 1, gen_tp=1.0)


# --- invariants on simulated large worlds ------------------------------------------------

WORLDS = [  # (t, p, d, t_g, p_g)
    (8, 4, 8, 2, 1), (8, 8, 4, 4, 2), (4, 4, 16, 1, 4), (8, 2, 16, 8, 1), (2, 8, 12, 1, 2),
]


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: "t{}p{}d{}-tg{}pg{}".format(*w))
def test_groups_partition_the_world(world):
    t, p, d, tg, pg = world
    layout = plan_hybrid_layout(t, p, d, gen_tp=tg, gen_pp=pg)
    n = t * p * d
    assert n >= 128
    for groups, size in ((layout.gen_tp_groups, tg), (layout.gen_pp_groups, pg),
                         (layout.micro_dp_groups, layout.micro_dp),
                         (layout.gather_groups, t // tg), (layout.fold_groups, p // pg)):
        assert sorted(itertools.chain(*groups)) == list(range(n))
        assert {len(g) for g in groups} == {size}
    # every generation replica has exactly one rank per (gen tp, gen pp) coordinate
    replicas = {}
    for pl in layout.ranks:
        replicas.setdefault(pl.gen_dp_rank, set()).add((pl.gen_tp_rank, pl.gen_pp_rank))
    assert sorted(replicas) == list(range(d * layout.micro_dp))
    assert all(v == set(itertools.product(range(tg), range(pg))) for v in replicas.values())
    # a micro-DP group: one training replica, one generation shard coordinate
    for group in layout.micro_dp_groups:
        members = [layout.ranks[r] for r in group]
        assert len({(x.dp_rank, x.gen_tp_rank, x.gen_pp_rank) for x in members}) == 1
    # vLLM order: consecutive t_g ranks form the generation TP groups
    order = layout.vllm_rank_order
    assert tuple(order[i:i + tg] for i in range(0, n, tg)) == layout.gen_tp_groups
    assert sum(pl.is_collect for pl in layout.ranks) == layout.gen_dp
