"""Pure checks: parallel-size validation, ND-dispatch registration, engine/worker configs.

The live process-group cases (rank order on 4 ranks, re-initialisation with other sizes,
world-size mismatch inside a world) run in test_engine_parity.py and test_model.py.
"""
from __future__ import annotations

import pytest

from megaflow.megatron.engine_config import EngineConfig
from megaflow.megatron.parallel import ParallelInfo, nd_dispatch_info, validate_parallel_sizes
from megaflow.workers.config import MegatronWorkerConfig


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


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_seq_len=0), "max_seq_len"), (dict(micro_batch_size=0), "micro_batch_size"),
    (dict(lr=1e-3, min_lr=1e-2), "min_lr"), (dict(lr_warmup_steps=4, lr_decay_steps=4), "lr_decay_steps"),
    (dict(lr_decay_style="step"), "lr_decay_style"), (dict(lr_warmup_init=1.0, lr=1e-3), "lr_warmup_init"),
    (dict(loss_mask_keys=()), "loss_mask_keys"),
])
def test_engine_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_distributed_optimizer_default_follows_dp():
    assert not EngineConfig().resolve_distributed_optimizer(1)
    assert EngineConfig().resolve_distributed_optimizer(2)
    assert not EngineConfig(use_distributed_optimizer=False).resolve_distributed_optimizer(4)


def test_worker_config_validation_and_mini_batches():
    with pytest.raises(ValueError, match="exactly one of hf_config and model_path"):
        MegatronWorkerConfig()
    with pytest.raises(ValueError, match="dtype"):
        MegatronWorkerConfig(hf_config={}, dtype="fp8")
    cfg = MegatronWorkerConfig.from_dict(dict(hf_config={"model_type": "llama"}, ppo_mini_batch_size=8,
                                              engine={"lr": 1e-5}, actor={"entropy_coeff": 0.01}))
    assert cfg.engine.lr == 1e-5 and cfg.actor.needs_entropy
    assert cfg.mini_batch_rows_per_rank(dp_size=2, rows_per_rank=8) == 4
    with pytest.raises(ValueError, match="not divisible by the data parallel size 3"):
        cfg.mini_batch_rows_per_rank(dp_size=3, rows_per_rank=8)
