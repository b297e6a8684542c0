"""megatron-core's distributed optimizer: a checkpoint written at DP=2 resumes at DP=1.

Two updates at DP=2 (the optimizer state sharded over both ranks), save, then two more
updates: once continuing at DP=2, once after loading into a fresh DP=1 engine with the
whole batch. The losses and grad norms of both post-checkpoint updates agree within fp32
noise; the second one depends on the Adam moments restored by the first, and a control
resume without the optimizer state (fresh Adam) visibly differs, so the check can fail.
The save leaves no process behind on the ranks.
"""
from __future__ import annotations

import psutil
import pytest
import torch

from megaflow.utils.launch import run_distributed
from megatron_testlib import VOCAB, hf_causal_lm, hf_to_megatron_shard, load_shard, make_batch, tiny_llama_config

pytestmark = pytest.mark.slow


def _loss(outputs, mb, den):
    mask = mb["response_mask"].float()
    return -(outputs["log_probs"] * mask).sum() / den.num_tokens, {}


def _engine():
    from megaflow.megatron import model as M
    from megaflow.megatron import parallel
    from megaflow.megatron.engine import MegatronEngine
    from role_testlib import role_spec, seq_len_overrides

    cfg = tiny_llama_config()
    info = parallel.initialize_parallel(tp=1, pp=1, seed=1)
    spec = role_spec("actor", ["actor.tp=1", f"resources.procs_per_node={info.world_size}", *seq_len_overrides(16),
                               "actor.ppo_micro_batch_size_per_gpu=2", "actor.optim.lr=0.01",
                               "actor.optim.lr_warmup_steps=0", "actor.use_distributed_optimizer=true"], hf_config=cfg)
    model = M.build_gpt_model(cfg)
    load_shard(model, hf_to_megatron_shard(hf_causal_lm(cfg, seed=7).state_dict(), cfg, tp_rank=0, tp=1, pp_rank=0,
                                           pp=1))
    engine = MegatronEngine(model, info, spec, vocab_size=VOCAB)
    return cfg, info, engine


def _rows(info, world):
    return {k: v.chunk(world)[info.dp_rank] for k, v in make_batch(0, batch=4).items()}


def _save_and_continue(rank, world, path):
    from megaflow.workers.checkpointing import save_engine_checkpoint

    cfg, info, engine = _engine()
    batch = _rows(info, world)
    for _ in range(2):
        engine.train_step(batch, _loss)
    save_engine_checkpoint(engine, path, cfg.to_dict())
    children = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
    return [engine.train_step(batch, _loss) for _ in range(2)], children


def _resume(rank, world, path, with_optimizer):
    from megaflow.models.checkpoint import load_checkpoint
    from megaflow.workers.checkpointing import MODEL_DIR, load_engine_checkpoint

    _, info, engine = _engine()
    if with_optimizer:
        load_engine_checkpoint(engine, path)
    else:
        load_checkpoint(engine.module, f"{path}/{MODEL_DIR}")
        engine.scheduler.num_steps = 2
    batch = _rows(info, world)
    return [engine.train_step(batch, _loss) for _ in range(2)]


def test_checkpoint_from_dp2_resumes_exactly_at_dp1(tmp_path):
    path = str(tmp_path / "ckpt")
    straight, children = run_distributed(_save_and_continue, 2, path, timeout_s=600)[0]
    # megatron-core's writer left a spawned multiprocessing manager per rank behind (the
    # in-process results queue of megaflow.models.checkpoint.save_sharded replaces it)
    assert children == []
    resumed = run_distributed(_resume, 1, path, True, timeout_s=600)[0]
    fresh_adam = run_distributed(_resume, 1, path, False, timeout_s=600)[0]
    for a, b in zip(straight, resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    # the first update after the checkpoint only needs the weights; the second needs Adam's moments
    assert fresh_adam[0]["loss"] == pytest.approx(straight[0]["loss"], rel=1e-5)
    assert abs(fresh_adam[1]["loss"] - straight[1]["loss"]) > 100 * abs(resumed[1]["loss"] - straight[1]["loss"])
