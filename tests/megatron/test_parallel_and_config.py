"""Pure checks: parallel-size validation and ND-dispatch registration (the settings the
engine and the workers read are tested in tests/config/test_role_spec.py).

The live process-group cases (rank order on 4 ranks, re-initialisation with other sizes,
world-size mismatch inside a world) run in test_engine_parity.py and test_model.py.
"""
from __future__ import annotations

import pytest

from megaflow.megatron.parallel import ParallelInfo, nd_dispatch_info, validate_parallel_sizes


@pytest.mark.parametrize("world, kwargs, dp", [
    (8, dict(tp=2, pp=2), 2), (4, dict(tp=4), 1), (6, dict(tp=2, cp=3), 1), (16, dict(tp=4, pp=2, dp=2), 2),
])
def test_valid_layouts_give_dp(world, kwargs, dp):
    assert validate_parallel_sizes(world, **kwargs) == dp


@pytest.mark.parametrize("world, kwargs, message", [
    (6, dict(tp=4), "not divisible by tp\\*pp\\*cp"),
    (8, dict(tp=2, pp=2, dp=4), "world size 8 != tp\\*pp\\*cp\\*dp"),
    (4, dict(tp=0), "tp must be an integer >= 1"),
    (4, dict(pp=1, vpp=2), "needs pp > 1"),
    (4, dict(tp=2.0), "tp must be an integer"),
])
def test_invalid_layouts_raise(world, kwargs, message):
    with pytest.raises(ValueError, match=message):
        validate_parallel_sizes(world, **kwargs)


def _info(tp_rank, pp_rank, dp_rank, cp_rank=0, pp_size=2):
    return ParallelInfo(rank=0, world_size=8, tp_rank=tp_rank, tp_size=2, pp_rank=pp_rank,
                        pp_size=pp_size, dp_rank=dp_rank, dp_size=2, cp_rank=cp_rank, cp_size=2,
                        vpp_size=None, tp_group=None, pp_group=None, dp_group=None,
                        dp_cp_group=None, cp_group=None, model_parallel_group=None)


@pytest.mark.parametrize("tp_rank, pp_rank, cp_rank, collect", [
    (0, 1, 0, True), (1, 1, 0, False), (0, 0, 0, False), (0, 1, 1, False)])
def test_nd_dispatch_collects_on_tp0_cp0_last_stage(tp_rank, pp_rank, cp_rank, collect):
    assert nd_dispatch_info(_info(tp_rank, pp_rank, 1, cp_rank)) == (1, collect)
